"""A library's names imported when a point is built (``library``): where the library does not
import, the point is ``unsupported`` with the reason, not an error. Shared by the adapters
(variants/adapters.py, which re-exports it) and the library's rotary embeddings
(variants/library_rotary.py)."""


def library(module: str, *names: str):
    """``names`` imported from ``module`` when a point is built; where the library does not
    import, NotImplementedError with the reason (the point is ``unsupported``, not an error)."""
    import importlib

    try:
        found = importlib.import_module(module)
        return tuple(getattr(found, name) for name in names)
    except Exception as e:
        raise NotImplementedError(
            f"{module} does not import here ({type(e).__name__}: {e}); see "
            "docs/guide.md, 'Checking a decoder's attention from a library'"
        ) from e

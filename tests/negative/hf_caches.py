"""transformers' own DynamicCache behind the harness's cache interface, as a new user writes it:
its ``update`` commits (every call appends for good), so the timed calls after the check attend
to a longer and longer cache unless the cache is rewound (docs/adding.md, "The KV cache
contract"). Imported only where transformers is (tests/test_timed_is_checked.py)."""

from transformers import DynamicCache

from variants.separate import SeparateProjMHA


class Dynamic:
    """DynamicCache's one layer: ``update`` appends and returns every key so far."""

    def __init__(self):
        self.cache, self.prefix = DynamicCache(), 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def update(self, k, v):
        return self.cache.update(k, v, 0)  # (B, Hkv, P + L, D), committed

    def advance(self):
        self.prefix = self.length  # nothing to commit: where a rewind returns to


class RewoundDynamic(Dynamic):
    def rewind(self):
        if self.length > self.prefix:  # crop takes how many tokens to drop, negated
            self.cache.crop(-(self.length - self.prefix))


class DynamicKept(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return Dynamic()


class DynamicRewound(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return RewoundDynamic()

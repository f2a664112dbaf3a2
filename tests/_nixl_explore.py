import functools
import importlib
import torchrefit as tr


def patched_world(rank, world, module, *args):
    orig = tr.Refitter.__init__

    @functools.wraps(orig)
    def init(self, *a, **k):
        if k.get("transport", "auto") == "auto":
            k["transport"] = "nixl"
        return orig(self, *a, **k)
    tr.Refitter.__init__ = init
    mod = importlib.import_module(module)
    return mod._world(rank, world, *args)

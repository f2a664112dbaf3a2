"""``layout.walk.named_modules``: the same list as ``list(root.named_modules())`` (the
oracle), by a loop: pre-order, each module once under its first name (a module
shared by two parents, a ``None`` child), and torch's own walk for a tree holding a
module whose class walks its own way."""

from __future__ import annotations

from torch import nn

from torchrefit.layout.walk import named_modules, shared_walks


def _tree() -> nn.Module:
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(nn.Linear(2, 2), shared, nn.ReLU())
    root = nn.ModuleDict({"a": inner, "b": nn.Sequential(shared, nn.Linear(2, 2)), "c": nn.Identity()})
    root.register_module("none", None)
    root.add_module("d", nn.Sequential(nn.Sequential(nn.Tanh(), inner)))
    return root


def _ids(walk):
    return [(name, id(m)) for name, m in walk]


def test_walk_is_torchs_named_modules() -> None:
    root = _tree()
    want = _ids(root.named_modules())
    assert _ids(named_modules(root)) == want
    with shared_walks():
        first = named_modules(root)
        assert _ids(first) == want and named_modules(root) is first  # walked once in the block


class _Own(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self  # hides its children


def test_a_class_walking_its_own_way_gets_torchs_walk() -> None:
    root = nn.Sequential(nn.Linear(2, 2), _Own())
    assert _ids(named_modules(root)) == _ids(root.named_modules())
    assert len(named_modules(root)) == 3


def test_a_module_walking_its_own_way_gets_torchs_walk() -> None:
    own = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    own.named_modules = lambda memo=None, prefix="", remove_duplicate=True: iter([(prefix, own)])
    root = nn.Sequential(nn.Linear(2, 2), own)
    assert _ids(named_modules(root)) == _ids(root.named_modules())
    assert len(named_modules(root)) == 3  # its two children hidden, as torch's walk hides them

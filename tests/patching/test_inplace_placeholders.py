"""In-place patching of a placeholder attribute (Megatron's ``get_cpu_offload_context = None``
without Transformer Engine): the attribute is replaced and restored, and other attributes of the
package that merely equal the placeholder (``None``) are not taken for its copies."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from acshim.patching.inplace import PatchEntry, apply_entries
from acshim.patching.journal import Journal


@pytest.fixture
def package() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    root, block = types.ModuleType("placeholderpkg"), types.ModuleType("placeholderpkg.block")
    block.get_offload_context = None
    root.unrelated = None
    block.also_none = None
    sys.modules.update({"placeholderpkg": root, "placeholderpkg.block": block})
    yield root, block
    del sys.modules["placeholderpkg"], sys.modules["placeholderpkg.block"]


def test_a_none_placeholder_is_replaced_alone_and_restored(package: tuple[types.ModuleType, types.ModuleType]) -> None:
    root, block = package

    def facade() -> str:
        return "acshim"

    entry = PatchEntry.parse(("placeholderpkg.block", "get_offload_context", "x.y"), "test")
    journal = Journal()
    apply_entries(block, [(entry, facade)], journal, lambda *_: pytest.fail("reported missing"))
    assert block.get_offload_context is facade
    assert root.unrelated is None and block.also_none is None
    journal.rollback()
    assert block.get_offload_context is None

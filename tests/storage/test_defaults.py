"""Engine-wide defaults facades write (SMP v2's horizon) and scopes read; bad values named."""

from __future__ import annotations

import pytest

import acshim
from acshim.storage import (
    BoundaryOffload,
    boundary_offload,
    get_defaults,
    offload,
    region_option_changes,
    set_defaults,
)


def test_scopes_take_unset_options_from_the_defaults():
    previous = set_defaults(prefetch=5, min_bytes=0)
    assert (previous.prefetch, previous.min_bytes) == (2, 1024)
    assert offload().options.prefetch == 5 and boundary_offload().options.min_bytes == 0
    assert offload(prefetch=1).options.prefetch == 1
    set_defaults(**vars(previous))
    assert get_defaults() == previous


@pytest.mark.parametrize("changes,message", [
    ({"storage": "gpu"}, "storage must be one of"),
    ({"prefetch": -1}, "prefetch must be a non-negative int"),
    ({"prefetch": True}, "prefetch must be a non-negative int"),
    ({"min_bytes": -5}, "min_bytes must be a non-negative int"),
])
def test_bad_values_name_the_argument(changes, message):
    with pytest.raises(ValueError, match=message):
        set_defaults(**changes)
    with pytest.raises(ValueError, match=message):
        offload(**changes)


def test_unknown_default_is_a_type_error():
    with pytest.raises(TypeError):
        set_defaults(horizon=3)


def test_region_option_changes_share_one_schedule_across_regions():
    assert region_option_changes() == {}
    changes = region_option_changes(storage="host", prefetch=3)
    scope = changes["saved_tensors_scope"]
    assert isinstance(scope, BoundaryOffload) and scope.options.prefetch == 3
    options = acshim.build_options(**changes)
    assert options.saved_tensors_scope is scope


def test_acshim_offload_is_the_engine_entry_point():
    assert acshim.offload is offload

"""The traits table covers every kind, and agrees with the kinds' sets in driver/inventory/sharing.py."""

from driver.inventory.device_kinds import KIND_TRAITS
from driver.inventory.sharing import ALL_KINDS, MIG_KINDS


def test_every_kind_has_its_traits_and_the_partition_kinds_are_the_mig_kinds():
    assert set(KIND_TRAITS) == ALL_KINDS
    assert {kind for kind, traits in KIND_TRAITS.items() if traits.in_partition} == MIG_KINDS


def test_only_a_whole_gpu_changes_nothing_on_the_gpu_and_a_share_is_mps_or_time_sliced():
    assert [kind for kind, traits in KIND_TRAITS.items() if not traits.changes_gpu] == ["whole"]
    assert all(not (traits.mps and traits.time_sliced) for traits in KIND_TRAITS.values())
    assert {kind for kind, traits in KIND_TRAITS.items() if traits.shared} == {
        "mps",
        "timeslice",
        "mig-mps",
        "mig-timeslice",
    }

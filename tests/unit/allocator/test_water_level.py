"""Where kube-scheduler's pods without claims will leave the nodes' rooms (driver/allocator/water_level.py):
the demand still to come, the level it fills the emptiest nodes down to, a room capped at it."""

from __future__ import annotations

import pytest

from driver.allocator.water_level import HORIZON, Room, capped, demand_to_come, level


def test_the_pods_without_claims_to_come_take_as_much_per_free_gpu_as_they_took_per_gpu_used():
    # 300 CPUs used over 10 GPUs in use, the claims' pods asking 20 a GPU: the other 100 are the
    # pods without claims', 10 a GPU; the next quarter of 24 GPUs free brings 60 more.
    assert HORIZON == 0.25
    assert demand_to_come({"cpu": 300.0, "memory": 80.0}, {"cpu": 20.0, "memory": 10.0}, 10, 24) == {
        "cpu": pytest.approx(60.0),
        "memory": 0.0,  # the claims' pods take all of it: nothing is theirs
    }
    assert demand_to_come({"cpu": 300.0}, {"cpu": 20.0}, 0, 6) == {}  # no GPU in use: no mix to go by


def test_the_level_fills_the_emptiest_nodes_first():
    rooms = [
        Room({"cpu": 100.0}, {"cpu": 100.0}),  # empty: 1.0 free
        Room({"cpu": 50.0}, {"cpu": 100.0}),  # 0.5
        Room({"cpu": 40.0}, {"cpu": 200.0}),  # 0.2
    ]
    # 50 take the empty node down to 0.5; 10 more over the two nodes' 200 take them to 0.45
    assert level(rooms, {"cpu": 60.0}) == {"cpu": pytest.approx(0.45)}
    assert level(rooms, {"cpu": 30.0}) == {"cpu": pytest.approx(0.7)}  # the empty node alone
    # past 0.45 the third node is reached: 10 over 200 to 0.45 ... 0.2 is 50 more (110 in all)
    assert level(rooms, {"cpu": 110.0}) == {"cpu": pytest.approx(0.2)}
    assert level(rooms, {"cpu": 1000.0}) == {"cpu": 0.0}  # more than all the room left
    assert level(rooms, {"cpu": 0.0}) == {}  # nothing to come: no level


def test_a_room_is_capped_at_the_level_and_what_is_not_levelled_stays():
    room = {"cpu": 90.0, "memory": 10.0, "pods": 100.0}
    allocatable = {"cpu": 100.0, "memory": 100.0, "pods": 110.0}
    assert capped(room, allocatable, {"cpu": 0.3, "memory": 0.5}) == {"cpu": 30.0, "memory": 10.0, "pods": 100.0}

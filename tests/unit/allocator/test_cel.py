"""CEL selectors in the DRA environment: libraries, upstream's error behaviour, limits."""

from __future__ import annotations

from fractions import Fraction

import pytest

from driver.allocator.cel import SelectorError, compile_selector, device_input, estimated_cost

GiB = 2**30
DEVICE = device_input(
    "gpu.fgpu.dev",
    {
        "type": ("string", "mig"),
        "index": ("int", 3),
        "driverVersion": ("version", "550.54.15"),
        "resource.kubernetes.io/pciBusID": ("string", "0000:3b:00.0"),
    },
    {"memory": Fraction(20 * GiB)},
    allow_multiple_allocations=False,
)


def matches(expression: str) -> bool:
    return compile_selector(expression).matches(DEVICE)


@pytest.mark.parametrize(
    "expression",
    [
        'device.driver == "gpu.fgpu.dev" && device.attributes["gpu.fgpu.dev"].type == "mig"',
        'device.attributes["resource.kubernetes.io"].pciBusID.startsWith("0000:3b")',
        'device.capacity["gpu.fgpu.dev"].memory == quantity("20480Mi")',
        'device.capacity["gpu.fgpu.dev"].memory.compareTo(quantity("10Gi")) > 0',
        'device.capacity["gpu.fgpu.dev"].memory.isLessThan(quantity("20Gi").add(1))',
        'device.capacity["gpu.fgpu.dev"].memory.asInteger() == 21474836480',
        'device.attributes["gpu.fgpu.dev"].driverVersion.isGreaterThan(semver("550.9.0"))',
        'device.attributes["gpu.fgpu.dev"].driverVersion.major() == 550',
        'semver("1.0.0-rc.1").isLessThan(semver("1.0.0")) && semver("v1.2", true) == semver("1.2.0")',
        'device.attributes["other.example.com"].size() == 0',
        '!has(device.attributes["other.example.com"].anything)',
        'device.attributes["gpu.fgpu.dev"].exists(name, name == "index")',
        'cel.bind(i, device.attributes["gpu.fgpu.dev"].index, i > 2 && i < 4)',
        "!device.allowMultipleAllocations",
        'isQuantity("1.5Gi") && !isQuantity("lots")',
    ],
)
def test_true_on_the_device(expression: str):
    assert matches(expression)


def test_false_is_false():
    assert not matches('device.attributes["gpu.fgpu.dev"].type == "gpu"')


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ('device.attributes["gpu.fgpu.dev"].missing == 1', "no such key: missing"),
        ('device.attributes["other.example.com"].missing == 1', "no such key: missing"),
        ('quantity("1.5").asInteger() == 1', "cannot convert"),
        ('semver("1.0.0").isLessThan(quantity("1"))', "not a semver"),
        ('quantity("many") == quantity("1")', "quantities must match"),
        ('quantity("1e999999999") == quantity("1")', "exponent out of range"),
        ("device.driver", "returned str, not bool"),
    ],
)
def test_runtime_errors_name_the_cause(expression: str, message: str):
    with pytest.raises(SelectorError, match=message):
        matches(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("device.nodeName == 1", "undefined field 'nodeName'"),
        ('"gpu" + "s"', "must evaluate to bool"),
        ("device.driver ==", "compilation failed"),
        ("true || " * 1500 + "true", "longer than"),
        ("[1].all(a, [1].all(b, [1].all(c, [1].all(d, true))))", "exceeds the limit"),
    ],
)
def test_compile_errors(expression: str, message: str):
    with pytest.raises(SelectorError, match=message):
        compile_selector(expression)


def test_each_expression_compiles_once():
    expression = 'device.attributes["gpu.fgpu.dev"].index == 3'
    assert compile_selector(expression) is compile_selector(expression)


def test_cost_estimate_grows_with_nesting():
    flat = estimated_cost('device.attributes["gpu.fgpu.dev"].exists(n, n == "x")')
    nested = estimated_cost('device.attributes["d"].exists(n, device.attributes["d"].exists(m, m == n))')
    assert nested > 30 * flat > 0


@pytest.mark.parametrize(
    ("expression", "reads"),
    [
        (
            'device.attributes["gpu.fgpu.dev"].type == "mig" && device.driver == "gpu.fgpu.dev"',
            (("attributes", "gpu.fgpu.dev", "type"), ("driver",)),
        ),
        (
            'has(device.attributes[\'d\'].x) && device.capacity["d"].memory.isLessThan(quantity("1Gi"))',
            (("attributes", "d", "x"), ("capacity", "d", "memory")),
        ),
        ("!device.allowMultipleAllocations || !device.allowMultipleAllocations", (("allowMultipleAllocations",),)),
        ('device.attributes["d"].size() == 0', None),  # a method on the whole map
        ('device.attributes["d"].exists(n, n == "x")', None),  # a comprehension over it
        ('device.attributes["d"]["x"] == 1', None),
        ('cel.bind(d, device, d.driver == "x")', None),
        ('"device" == device.driver', None),  # `device` in a literal, not a read: no guessing
    ],
)
def test_what_a_selector_reads_decides_which_devices_share_its_result(expression: str, reads: tuple | None):
    assert compile_selector(expression).reads == reads

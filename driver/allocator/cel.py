"""CEL selectors in the Kubernetes DRA environment, on the official C++ runtime (cel-expr-python).

`device.driver`, `device.allowMultipleAllocations`, `device.attributes[<domain>].<id>` and
`device.capacity[<domain>].<id>` (a quantity); the Kubernetes quantity and semver libraries, with
version attributes as semver values. Quantities and semvers are one small protobuf message (kind and
canonical form), so `==` compares values ("1Gi" == "1024Mi"); the runtime dispatches member functions
by value kind (all messages alike), so one message type carries both and the functions check kinds.
Like upstream, an unknown domain gives an empty map and an unknown field is an error.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_math, ext_optional, ext_strings
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from driver.common.quantity import Amount, QuantityError, QuantityOutOfRange, parse_quantity

MAX_EXPRESSION_LENGTH = 10 * 1024
COST_LIMIT = 1_000_000
MAX_MAP_SIZE = 32  # attributes + capacities a device: what a comprehension over a device map may visit
DEVICE_FIELDS = ("driver", "attributes", "capacity", "allowMultipleAllocations")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_DEVICE_FIELD = re.compile(r"\bdevice\s*\.\s*([A-Za-z_]\w*)")
_MACRO = re.compile(r"\.\s*(all|exists|exists_one|map|filter)\s*\($")


class SelectorError(Exception):
    """A selector that does not compile, or fails on a device. The message says which and why."""


def _scalar_type() -> type:
    file = descriptor_pb2.FileDescriptorProto(name="fgpu_cel.proto", package="fgpu.cel", syntax="proto3")
    message = file.message_type.add(name="Scalar")
    for number, name in enumerate(("kind", "canonical"), start=1):
        message.field.add(name=name, number=number, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=1)
    _POOL.Add(file)
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName("fgpu.cel.Scalar"))


_POOL = descriptor_pool.DescriptorPool()
ScalarMessage = _scalar_type()
QUANTITY = SEMVER = cel.Type("fgpu.cel.Scalar")
T = cel.Type


# Quantities -------------------------------------------------------------------------------------


def quantity_value(value: Amount) -> Any:
    return ScalarMessage(kind="quantity", canonical=f"{value.numerator}/{value.denominator}")


def _q(message: Any) -> Fraction:
    if message.kind != "quantity":
        raise ValueError(f"no such overload: a {message.kind} is not a quantity")
    return Fraction(message.canonical)


def _quantity(text: str) -> Any:
    try:
        return quantity_value(parse_quantity(text))
    except QuantityOutOfRange as error:
        raise ValueError(str(error)) from error
    except QuantityError as error:
        raise ValueError(f"quantities must match the regular expression, got {text!r}") from error


def _is_quantity(text: str) -> bool:
    try:
        parse_quantity(text)
    except QuantityError:
        return False
    return True


def _compare(a: Fraction, b: Fraction) -> int:
    return (a > b) - (a < b)


def _as_integer(message: Any) -> int:
    value = _q(message)
    if value.denominator != 1 or not -(2**63) <= value.numerator < 2**63:
        raise ValueError("cannot convert value to integer: out of range or not a whole number")
    return value.numerator


def _quantity_functions() -> list[cel.FunctionDecl]:
    def member(name: str, ret: cel.Type, params: list[cel.Type], impl: Any, suffix: str = "") -> cel.FunctionDecl:
        overload = cel.Overload(f"quantity_{name}{suffix}", ret, [QUANTITY, *params], is_member=True, impl=impl)
        return cel.FunctionDecl(name, [overload])

    return [
        cel.FunctionDecl("quantity", [cel.Overload("string_to_quantity", QUANTITY, [T.STRING], impl=_quantity)]),
        cel.FunctionDecl("isQuantity", [cel.Overload("is_quantity_string", T.BOOL, [T.STRING], impl=_is_quantity)]),
        member("sign", T.INT, [], lambda q: _compare(_q(q), Fraction(0))),
        member("isInteger", T.BOOL, [], lambda q: _q(q).denominator == 1 and -(2**63) <= _q(q) < 2**63),
        member("asInteger", T.INT, [], _as_integer),
        member("asApproximateFloat", T.DOUBLE, [], lambda q: float(_q(q))),
        cel.FunctionDecl(
            "add",
            [
                cel.Overload(
                    "quantity_add", QUANTITY, [QUANTITY, QUANTITY], True, lambda a, b: quantity_value(_q(a) + _q(b))
                ),
                cel.Overload(
                    "quantity_add_int", QUANTITY, [QUANTITY, T.INT], True, lambda a, b: quantity_value(_q(a) + b)
                ),
            ],
        ),
        cel.FunctionDecl(
            "sub",
            [
                cel.Overload(
                    "quantity_sub", QUANTITY, [QUANTITY, QUANTITY], True, lambda a, b: quantity_value(_q(a) - _q(b))
                ),
                cel.Overload(
                    "quantity_sub_int", QUANTITY, [QUANTITY, T.INT], True, lambda a, b: quantity_value(_q(a) - b)
                ),
            ],
        ),
    ]


# Semantic versions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Version:
        match = _SEMVER.match(text)
        if not match:
            raise ValueError(f"could not parse {text!r} as semver")
        prerelease = tuple(match.group(4).split(".")) if match.group(4) else ()
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3)), prerelease)

    def canonical(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return core + ("-" + ".".join(self.prerelease) if self.prerelease else "")

    def key(self) -> tuple[Any, ...]:
        # semver 2.0 precedence: a pre-release sorts before its release; numeric identifiers
        # sort numerically and before alphanumeric ones.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)


def semver_value(text: str) -> Any:
    return ScalarMessage(kind="semver", canonical=Version.parse(text).canonical())


def _v(message: Any) -> Version:
    if message.kind != "semver":
        raise ValueError(f"no such overload: a {message.kind} is not a semver")
    return Version.parse(message.canonical)


def _normalize_semver(text: str) -> str:
    # semver(text, true): "v1.2" -> "1.2.0", leading zeros dropped, as upstream's normalisation.
    text = text.removeprefix("v")
    split = re.match(r"^([0-9.]*)(.*)$", text)
    core, rest = split.group(1), split.group(2)  # type: ignore[union-attr]
    parts = [str(int(p)) if p.isdigit() else p for p in core.split(".") if p != ""]
    parts += ["0"] * (3 - len(parts))
    return ".".join(parts) + rest


def _is_semver(text: str, normalize: bool = False) -> bool:
    try:
        Version.parse(_normalize_semver(text) if normalize else text)
    except ValueError:
        return False
    return True


def _order(a: Any, b: Any) -> int:
    if a.kind == "semver":
        return _compare(_v(a).key(), _v(b).key())  # type: ignore[arg-type]
    return _compare(_q(a), _q(b))


def _ordering(name: str, ret: cel.Type, result: Any) -> cel.FunctionDecl:
    overload = cel.Overload(f"scalar_{name}", ret, [QUANTITY, QUANTITY], True, lambda a, b: result(_order(a, b)))
    return cel.FunctionDecl(name, [overload])


def _semver_functions() -> list[cel.FunctionDecl]:
    def member(name: str, ret: cel.Type, params: list[cel.Type], impl: Any) -> cel.Overload:
        return cel.Overload(f"semver_{name}", ret, [SEMVER, *params], is_member=True, impl=impl)

    return [
        cel.FunctionDecl(
            "semver",
            [
                cel.Overload("string_to_semver", SEMVER, [T.STRING], impl=semver_value),
                cel.Overload(
                    "string_bool_to_semver",
                    SEMVER,
                    [T.STRING, T.BOOL],
                    impl=lambda s, n: semver_value(_normalize_semver(s) if n else s),
                ),
            ],
        ),
        cel.FunctionDecl(
            "isSemver",
            [
                cel.Overload("is_semver_string", T.BOOL, [T.STRING], impl=_is_semver),
                cel.Overload("is_semver_string_bool", T.BOOL, [T.STRING, T.BOOL], impl=_is_semver),
            ],
        ),
        cel.FunctionDecl("major", [member("major", T.INT, [], lambda v: _v(v).major)]),
        cel.FunctionDecl("minor", [member("minor", T.INT, [], lambda v: _v(v).minor)]),
        cel.FunctionDecl("patch", [member("patch", T.INT, [], lambda v: _v(v).patch)]),
        _ordering("isGreaterThan", T.BOOL, lambda order: order > 0),
        _ordering("isLessThan", T.BOOL, lambda order: order < 0),
        _ordering("compareTo", T.INT, lambda order: order),
    ]


# The environment --------------------------------------------------------------------------------


@functools.cache
def _environment() -> Any:
    return cel.NewEnv(
        _POOL,
        variables={"device": T.Map(T.STRING, T.DYN)},
        extensions=[
            ext_bindings.ExtBindings(),
            ext_strings.ExtStrings(),
            ext_math.ExtMath(),
            ext_optional.ExtOptional(),
        ],
        functions=_quantity_functions() + _semver_functions(),
    )


def estimated_cost(expression: str) -> int:
    """A conservative static cost: each comprehension may visit a whole device map (32 entries),
    nested ones multiply. Upstream estimates from the checked AST; this is coarser, never lower."""
    code = _STRING_LITERAL.sub('""', expression)
    depth = deepest = 0
    stack: list[bool] = []
    for index, char in enumerate(code):
        if char == "(":
            is_macro = bool(_MACRO.search(code[: index + 1]))
            stack.append(is_macro)
            depth += is_macro
            deepest = max(deepest, depth)
        elif char == ")" and stack:
            depth -= stack.pop()
    tokens = len(re.findall(r"\w+|[^\s\w]", code))
    return tokens * MAX_MAP_SIZE**deepest


_DEVICE_WORD = re.compile(r"\bdevice\b")
_READ_FLAG = re.compile(r"device\s*\.\s*(driver|allowMultipleAllocations)\b(?!\s*\()")
_READ_ENTRY = re.compile(
    r"device\s*\.\s*(attributes|capacity)\s*\[\s*(?:\"([^\"\\]*)\"|'([^'\\]*)')\s*\]"
    r"\s*\.\s*([A-Za-z_]\w*)\b(?!\s*\()"
)


def device_reads(expression: str) -> tuple[tuple[str, ...], ...] | None:
    """What of the device an expression reads: ("driver",), ("allowMultipleAllocations",) or
    (attributes | capacity, domain, name), when every use of `device` is one of these plain reads;
    its result is then a function of their values, so devices that agree on them share it. None
    when `device` is used otherwise (a whole map, a comprehension, a method on a map, a field of
    something else). The text is not parsed: `device` in a string literal gives None, or a read
    too many, never one too few."""
    reads: list[tuple[str, ...]] = []
    for word in _DEVICE_WORD.finditer(expression):
        if expression[: word.start()].rstrip().endswith("."):
            return None
        flag = _READ_FLAG.match(expression, word.start())
        entry = _READ_ENTRY.match(expression, word.start())
        if flag:
            reads.append((flag.group(1),))
        elif entry:
            domain = entry.group(2) if entry.group(2) is not None else entry.group(3)
            reads.append((entry.group(1), domain, entry.group(4)))
        else:
            return None
    return tuple(dict.fromkeys(reads))


@dataclass(frozen=True)
class CompiledSelector:
    expression: str
    program: Any
    domains: frozenset[str]  # string literals: the domains an expression may index
    reads: tuple[tuple[str, ...], ...] | None  # see device_reads

    def matches(self, device: dict[str, Any]) -> bool:
        """Evaluates on a device made by `device_input`; raises SelectorError on a runtime error."""
        activation = device
        missing = [d for d in self.domains if d not in device["attributes"] or d not in device["capacity"]]
        if missing:
            activation = dict(device)
            activation["attributes"] = {**{d: {} for d in missing}, **device["attributes"]}
            activation["capacity"] = {**{d: {} for d in missing}, **device["capacity"]}
        try:
            value = self.program.eval(data={"device": activation})
        except Exception as error:  # failures outside the evaluation proper (conversions)
            raise SelectorError(f"CEL runtime error: {_runtime_message(error)}") from None
        result = value.value()
        if value.type() == T.ERROR:
            raise SelectorError(f"CEL runtime error: {_runtime_message(Exception(result))}")
        if not isinstance(result, bool):
            raise SelectorError(f"CEL runtime error: the expression returned {type(result).__name__}, not bool")
        return result


def _runtime_message(error: Exception) -> str:
    text = str(error)
    match = re.search(r'Key not found in map : "([^"]*)"', text)
    if match:
        return f"no such key: {match.group(1)}"
    return re.sub(r"^[A-Z_]+: ", "", text).removesuffix(" [INVALID_ARGUMENT]")


_lock = threading.Lock()


@functools.lru_cache(maxsize=4096)
def _compile_cached(expression: str) -> CompiledSelector | str:
    if len(expression) > MAX_EXPRESSION_LENGTH:
        return f"expression is longer than {MAX_EXPRESSION_LENGTH} bytes"
    for name in _DEVICE_FIELD.findall(_STRING_LITERAL.sub('""', expression)):
        if name not in DEVICE_FIELDS:
            return f"compilation failed: undefined field '{name}'"
    env = _environment()
    try:
        program = env.compile(expression)
    except Exception as error:
        if "cannot be the range of a comprehension" not in str(error):
            return f"compilation failed: {_runtime_message(error)}"
        program = env.compile(expression, disable_check=True)  # the checker cannot type a dyn range
    if program.return_type() not in (T.BOOL, T.DYN):
        return f"must evaluate to bool, not {program.return_type().name()}"
    cost = estimated_cost(expression)
    if cost > COST_LIMIT:
        return f"estimated cost {cost} exceeds the limit of {COST_LIMIT}"
    domains = frozenset(literal[1:-1] for literal in _STRING_LITERAL.findall(expression))
    return CompiledSelector(expression, program, domains, device_reads(expression))


def compile_selector(expression: str) -> CompiledSelector:
    """Compiles once per expression (cached); raises SelectorError with the reason."""
    with _lock:
        result = _compile_cached(expression)
    if isinstance(result, str):
        raise SelectorError(result)
    return result


def attribute_value(kind: str, value: Any) -> Any:
    if kind == "version":
        return semver_value(str(value))
    return value


def device_input(
    driver: str,
    attributes: dict[str, tuple[str, Any]],
    capacity: dict[str, Amount],
    allow_multiple_allocations: bool,
) -> dict[str, Any]:
    """The `device` variable: names without a domain belong to the driver's domain."""
    attribute_maps: dict[str, dict[str, Any]] = {}
    for name, (kind, value) in attributes.items():
        domain, _, ident = name.rpartition("/")
        attribute_maps.setdefault(domain or driver, {})[ident] = attribute_value(kind, value)
    capacity_maps: dict[str, dict[str, Any]] = {}
    for name, amount in capacity.items():
        domain, _, ident = name.rpartition("/")
        capacity_maps.setdefault(domain or driver, {})[ident] = quantity_value(amount)
    return {
        "driver": driver,
        "allowMultipleAllocations": allow_multiple_allocations,
        "attributes": attribute_maps,
        "capacity": capacity_maps,
    }

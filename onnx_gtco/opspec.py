"""What a fused op is, defined once per kernel family: its operand roles, its typed attributes, its dtypes.

A rule (onnx_gtco.patterns) says which tensor plays which role; the rewrite (onnx_gtco.rewrite) writes the fused
node's inputs and outputs in role order through `OpSpec.order` and its attributes through `OpSpec.encode`; kernel
selection, tuning and the library read a node back through `decode`, the one decoder. The present roles lead, in
role order, and the node's `roles` / `out_roles` attributes name them (an absent role is left out: ORT's custom
ops take no empty name among variadic inputs, so a role's index cannot be fixed by an empty placeholder); the
inputs after the roles are what else the group's nodes read (a GELU's constants, a head split's shapes), in the
order the group reads them. Families with `roles=None` (elementwise) keep that order for all their inputs.

A fused node's op type names its kernel family and I/O dtype: `Attention_f16`, `BmmSoftmax_f32`, `Gemm_bf16`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper

from onnx_gtco import families
from onnx_gtco.errors import RewriteError

DOMAIN = "ai.gtco"
FLOAT_DTYPES = ("f32", "f16", "bf16")
FP8_DTYPE = "f8"
"""The op-type tag of a GEMM on E4M3 operands with fp16 I/O (`Gemm_f8`, onnx_gtco.fp8)."""


def op_type(family: str, dtype: str) -> str:
    """`attention`, `f16` -> `Attention_f16`: the op type names the kernel family and I/O dtype."""
    return "".join(p.capitalize() for p in family.split("_")) + "_" + dtype


def split_op_type(op_type: str) -> tuple[str, str]:
    """`BmmSoftmax_f16` -> ("bmm_softmax", "f16"): the inverse of op_type."""
    head, _, dtype = op_type.rpartition("_")
    family = "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(head))
    return family, dtype


# Attribute kinds: how a value is written into the node and read back.
DIM = "dim"      # an int, or a symbolic dim's name ("?" when unnamed)
DIMS = "dims"    # a tuple of dims (a list of ints, or of strings once one dim is symbolic)
INT, FLOAT, BOOL, STR, STRS, INTS = "int", "float", "bool", "str", "strs", "ints"


@dataclass(frozen=True)
class Attr:
    """A typed attribute of a fused op; `default` is what an absent attribute means."""

    name: str
    kind: str
    default: Any = None


@dataclass(frozen=True)
class OpSpec:
    """One kernel family's contract.

    Attributes:
        family: the pattern family, the op type's stem (`gemm` -> `Gemm_f16`).
        roles: input roles in node-input order, None: no roles (the inputs keep the group's order).
        outputs: output roles in node-output order, None: no roles.
        attrs: the attributes a rule may set, with their kinds and defaults.
        dtypes: the I/O dtypes a kernel of the family takes.
        launches: the kernel launches of one node, from its attributes (a QKV node: one per projection); None: one.
        fp32_output: whether a half node, from its attributes, writes a float graph output in fp32 itself (its
            kernel's fp32-output epilogue: a GEMM without a residual); None: never.
        parts: the families of the groups a node of this op, from its attributes, replaces as one kernel (a GEMM
            with the LayerNorm over its rows: ("gemm", "layernorm")), whose two kernels the report prices beside
            it; None: it is no such composite.
        per_layer: whether a transformer layer holds one node of this op (attention), so the report counts
            launches per layer between two of them.
    """

    family: str
    roles: tuple[str, ...] | None
    outputs: tuple[str, ...] | None
    attrs: tuple[Attr, ...]
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    launches: Callable[[Mapping[str, Any]], int] | None = None
    fp32_output: Callable[[Mapping[str, Any]], bool] | None = None
    parts: Callable[[Mapping[str, Any]], tuple[str, ...] | None] | None = None
    per_layer: bool = False
    _by_name: dict[str, Attr] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {a.name: a for a in self.attrs})

    # --- writing -----------------------------------------------------------------------------------------------
    def order(self, bound: Mapping[str, str], external: Sequence[str], *, outputs: bool = False
              ) -> tuple[list[str], list[str]]:
        """The node's inputs (or outputs) and the roles of the leading ones: each present role's tensor in role
        order (a tensor playing several roles once, its roles joined by "+"), then the other `external` tensors in
        their order. A role without a tensor, or whose tensor the group computes itself (not one of `external`), is
        absent (the family's kernel then refuses the node where it needs that operand)."""
        roles = self.outputs if outputs else self.roles
        if roles is None:
            return list(external), []
        unknown = sorted(set(bound) - set(roles))
        if unknown:
            raise RewriteError(f"{self.family}: unknown {'output' if outputs else 'input'} roles {unknown}")
        named: dict[str, list[str]] = {}  # tensor -> its roles (q, k and v of a packed qkv share one input)
        for r in roles:
            if (t := bound.get(r, "")) in external:
                named.setdefault(t, []).append(r)
        return [*named, *(t for t in external if t not in named)], ["+".join(rs) for rs in named.values()]

    def encode(self, attrs: Mapping[str, Any], precision: str, roles: Sequence[str] = (),
               out_roles: Sequence[str] = ()) -> list[onnx.AttributeProto]:
        """The node's attributes, sorted by name: `attrs` (None and empty lists left out), the precision, and the
        roles of the leading inputs and outputs (`order`'s names; written for families with roles)."""
        out = [helper.make_attribute("precision", precision)]
        if self.roles is not None:
            out.append(helper.make_attribute("roles", list(roles), attr_type=onnx.AttributeProto.STRINGS))
        if self.outputs is not None:
            out.append(helper.make_attribute("out_roles", list(out_roles), attr_type=onnx.AttributeProto.STRINGS))
        for key, value in attrs.items():
            spec = self._by_name.get(key)
            if spec is None:
                raise RewriteError(f"{self.family}: attribute {key!r} is not in its spec")
            if value is None:
                continue
            v = _encode(value)
            if isinstance(v, list) and not v:
                continue
            out.append(helper.make_attribute(key, v))
        return sorted(out, key=lambda a: a.name)

    # --- reading -----------------------------------------------------------------------------------------------
    def attr_values(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Typed values of every spec attribute (the default where absent) and the precision."""
        out: dict[str, Any] = {"precision": _text(raw.get("precision", "fp32"))}
        for a in self.attrs:
            out[a.name] = _decode(a, raw[a.name]) if a.name in raw else a.default
        return out


def _text(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, (list, tuple)):
        return [_text(x) for x in v]
    return v


def _encode(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (tuple, list)):
        items = list(v)
        if all(isinstance(x, (bool, int)) for x in items):
            return [int(x) for x in items]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            return [float(x) for x in items]
        return [str(x) for x in items]
    return v


def _decode(a: Attr, v: Any) -> Any:
    v = _text(v)
    if a.kind == BOOL:
        return bool(v)
    if a.kind == FLOAT:
        return float(v)
    if a.kind in (DIMS, STRS, INTS):
        return tuple(v)
    return v


EPILOGUE = (Attr("bias", BOOL, False), Attr("activation", STR, "none"), Attr("residual", BOOL, False))
"""The epilogue attributes of the families that share one (the GEMM's and the conv's)."""


class _Specs(Mapping[str, "OpSpec"]):
    """Family name -> OpSpec, from each family's spec module (onnx_gtco.families), read on first use: a family's
    spec module imports this one."""

    @functools.cached_property
    def _specs(self) -> dict[str, OpSpec]:
        return {s.family: s for part in families.parts("spec") for s in part.SPECS}

    def __getitem__(self, family: str) -> OpSpec:
        return self._specs[family]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


SPECS: Mapping[str, OpSpec] = _Specs()


@dataclass(frozen=True)
class FusedOp:
    """A fused node read back through its family's spec.

    Attributes:
        spec: the family's OpSpec.
        dtype: the I/O dtype from the op type ("f32", "f16", "bf16").
        attrs: typed attribute values (defaults where absent) and "precision".
        inputs: role -> node input index, for the roles the node has (role families only).
        outputs: role -> node output index, likewise.
    """

    spec: OpSpec
    dtype: str
    attrs: dict[str, Any]
    inputs: dict[str, int]
    outputs: dict[str, int]

    @property
    def family(self) -> str:
        return self.spec.family

    def __getitem__(self, key: str) -> Any:
        return self.attrs[key]

    def int(self, key: str) -> int | None:
        """An integer attribute; None when absent or symbolic (a dim name or "?")."""
        v = self.attrs.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _roles(known: tuple[str, ...] | None, names: Any, tensors: Sequence[str]) -> dict[str, int]:
    """role -> index of the leading tensors the node's `roles` / `out_roles` attribute names."""
    if known is None or names is None:
        return {}
    return {r: i for i, rs in enumerate(_text(list(names))) for r in rs.split("+")
            if r in known and i < len(tensors) and tensors[i]}


def decode(op_type_name: str, raw_attrs: Mapping[str, Any], inputs: Sequence[str] = (),
           outputs: Sequence[str] = ()) -> FusedOp | str:
    """A fused node (op type, attributes as onnx.helper.get_attribute_value gives them, input and output names)
    through its family's spec, or why there is no spec for it."""
    family, dtype = split_op_type(op_type_name)
    spec = SPECS.get(family)
    if spec is None:
        return f"no fused-op spec for family {family!r} (op type {op_type_name})"
    return FusedOp(spec, dtype, spec.attr_values(raw_attrs), _roles(spec.roles, raw_attrs.get("roles"), inputs),
                   _roles(spec.outputs, raw_attrs.get("out_roles"), outputs))


def decode_node(node: onnx.NodeProto) -> FusedOp | str:
    """decode() of an `ai.gtco` NodeProto."""
    return decode(node.op_type, {a.name: helper.get_attribute_value(a) for a in node.attribute},
                  list(node.input), list(node.output))

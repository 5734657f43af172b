"""`kda.arguments`: one table of the public functions' arguments, from which their bodies, the replay keys, the
custom ops and `kda.distributed` are built. Each test states what a list spelt apart from the table could
break: a public signature that drifts from it, an argument a body drops or passes to another parameter, an op
schema or a replay key that misses an argument, an unknown keyword swallowed."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch

import kda
import kda.distributed
from kda import api, arguments, contract, distributed, library, replay

PUBLIC = {arguments.CHUNK: kda.chunk_kda, arguments.DECODE: kda.fused_recurrent_kda,
          arguments.DISTRIBUTED: kda.distributed.chunk_kda}


@pytest.mark.parametrize("fn", PUBLIC)
def test_public_signatures_are_the_tables(fn):
    """fla's first eight parameters positional, the rest keyword-only, every one named with its default and
    annotation as the table states, shown by `help()`, with the docstring kept."""
    f = PUBLIC[fn]
    sig = inspect.signature(f)
    assert sig.replace(return_annotation=inspect.Signature.empty) == arguments.signature(fn)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:8]] == ["q", "k", "v", "g", "beta", "scale", "initial_state",
                                             "output_final_state"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:8])
    assert all(p.kind is p.KEYWORD_ONLY for p in params[8:])
    assert f.__doc__ and f.__name__ == fn.split(".")[-1]
    text = pydoc.render_doc(f)
    assert all(p.name in text for p in params) and f.__doc__.split("\n")[0].strip() in text


def test_a_signature_written_apart_from_the_table_does_not_import():
    """A public signature missing an argument of the table (or with another default) raises at import."""
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        """Too few arguments."""

    with pytest.raises(TypeError, match="differs from kda.arguments"):
        arguments.compiled(arguments.CHUNK, "    return None\n", {})(chunk_kda)


@pytest.mark.parametrize("fn", PUBLIC)
def test_unknown_keywords_and_extra_positionals_are_type_errors(fn):
    f = PUBLIC[fn]
    x = torch.zeros(1, 1, 1, 4)
    with pytest.raises(TypeError, match="use_qk_l2norm"):
        f(x, x, x, x, x[..., 0], use_qk_l2norm=True)
    with pytest.raises(TypeError):
        f(x, x, x, x, x[..., 0], None, None, False, True)  # a ninth positional argument


def test_check_call_takes_every_argument_of_both_functions():
    # fn and require_has_initial_state say which function calls; oracle and allow_float64 are kda_reference's
    names = set(inspect.signature(contract.check_call).parameters) - {"fn", "require_has_initial_state", "oracle",
                                                                      "allow_float64"}
    assert names == set(arguments.names(arguments.CHUNK)) | set(arguments.names(arguments.DECODE))


class _Stop(Exception):
    pass


def _distinct_values(fn: str) -> dict:
    """A distinct object per argument of `fn` (none a tensor: the call takes the full path, which the spies stop)."""
    return {n: object() for n in arguments.names(fn)}


@pytest.mark.parametrize("fn", [arguments.CHUNK, arguments.DECODE])
def test_the_bodies_pass_every_argument_to_its_parameter(fn, monkeypatch):
    """The full path hands `kda.contract.check_call` each argument under its own name (and `fn`'s rule for
    has_initial_state); the traced path hands the custom op wrapper the same."""
    given = _distinct_values(fn)
    seen = {}

    def spy(name, *positional, **keywords):
        seen.update(zip(arguments.names(fn), positional), **keywords, fn=name)
        raise _Stop

    monkeypatch.setattr(api, "check_call", spy)
    with pytest.raises(_Stop):
        PUBLIC[fn](**given)
    assert seen.pop("fn") == fn
    assert seen.pop("require_has_initial_state") is (fn == arguments.CHUNK)
    assert seen == given

    seen.clear()

    def op_spy(op, *positional, **keywords):
        seen.update(zip(arguments.names(fn), positional), **keywords, op=op)
        raise _Stop

    monkeypatch.setattr(api, "_through_op", op_spy)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(_Stop):
        PUBLIC[fn](**given)
    assert seen.pop("op") is getattr(library, f"{fn}_op")
    assert seen == given


def test_distributed_forwards_every_argument(monkeypatch):
    """`kda.distributed.chunk_kda` hands `_chunk_kda` every argument: the ones it names by name, the others (the
    table's, such as the in-kernel flags) in `kernel_kw` for its local calls."""
    given = _distinct_values(arguments.DISTRIBUTED)
    seen = {}

    def spy(*positional, kernel_kw, fuse_identity, **keywords):
        seen.update(zip(arguments.names(arguments.DISTRIBUTED), positional), **keywords, **kernel_kw)
        assert not set(kernel_kw) & set(keywords) and fuse_identity is None
        raise _Stop

    monkeypatch.setattr(distributed, "_chunk_kda", spy)
    with pytest.raises(_Stop):
        kda.distributed.chunk_kda(**given)
    assert seen == given


@pytest.mark.parametrize("fn", [arguments.CHUNK, arguments.DECODE])
def test_op_schemas_follow_the_table(fn):
    """`kda::{fn}`'s schema: the table's op parameters in its order, `out` required, the trailing ones with
    their defaults, the table's mutated arguments written in place (and only those)."""
    schema = getattr(torch.ops.kda, fn).default._schema
    expected = arguments.op_arguments(fn)
    assert [a.name for a in schema.arguments] == [a.name for a in expected]
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == \
        set(arguments.mutated(fn)) == {"out", "state_cache", "errors"}
    for a, row in zip(schema.arguments, expected):
        assert a.has_default_value() == (row.op == arguments.OP_LAST), a.name
    assert not str(next(a for a in schema.arguments if a.name == "out").type).endswith("?")


def test_replay_keys_and_roles_cover_every_argument():
    """Every argument but the per-call seed is in its function's key (two calls that differ in it must not share
    a recording), and every tensor of either function has its role."""
    for fn, key in ((arguments.CHUNK, replay.chunk_key), (arguments.DECODE, replay.decode_key)):
        assert list(inspect.signature(key).parameters) == list(arguments.key_names(fn))
        assert set(arguments.names(fn)) - set(arguments.key_names(fn)) <= {"seed"}
        tensors = {a.name for a in arguments.of(fn) if a.kind == arguments.TENSOR} - {"out"}
        assert tensors <= set(replay.ROLES[:replay.ROLES.index("o")])
    assert replay.ROLES[-2:] == ("o", "final")

"""Bad arguments raise ArgumentError naming the problem, before any byte moves.

The group here is rank 1 of a 3-rank loopback job whose other ranks never run: a
check that were missing would start communicating and fail by timeout (1 s) instead.
"""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.errors import ArgumentError

from _coll_util import LONELY_SIZE

pytestmark = pytest.mark.timeout(30)

P = LONELY_SIZE  # group size; this rank is 1


@pytest.fixture
def g(lonely: ProcessGroup) -> ProcessGroup:
    return lonely


def f(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


# -- tensors and ops -----------------------------------------------------------------------
def test_non_tensor_argument_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="all_reduce: tensor must be a torch.Tensor, got list"):
        tandem.all_reduce([1.0, 2.0], group=g)  # type: ignore[arg-type]


def test_sparse_tensor_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="layout"):
        tandem.all_reduce(torch.zeros(3, 3).to_sparse(), group=g)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_nested_tensor_is_refused_with_what_to_pass_instead(g, layout) -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(ArgumentError, match="all_reduce: tensor is a nested tensor.*unbind"):
        tandem.all_reduce(nested, group=g)


VIEWS = {"conj": (lambda: torch.zeros(3, dtype=torch.complex64).conj(), "conjugate", "resolve_conj"),
         "neg": (lambda: torch.zeros(3)._neg_view(), "negative", "resolve_neg")}
CALLS = {
    "all_reduce": lambda g, t: tandem.all_reduce(t, group=g),
    "broadcast": lambda g, t: tandem.broadcast(t, 0, group=g),
    "all_gather in": lambda g, t: tandem.all_gather([t.resolve_conj().resolve_neg().clone()
                                                     for _ in range(P)], t, group=g),
    "all_gather out": lambda g, t: tandem.all_gather([t] * P, torch.zeros(3, dtype=t.dtype),
                                                     group=g),
    "send": lambda g, t: tandem.send(t, 0, group=g),
    "recv": lambda g, t: tandem.recv(t, 0, group=g),
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("call", list(CALLS))
def test_a_conjugate_or_negative_view_is_refused_with_what_to_pass(g, view, call) -> None:
    # its memory holds other values than its elements: moved as memory it would be wrong
    make, kind, fix = VIEWS[view]
    with pytest.raises(ArgumentError, match=f"is a {kind} view.*{fix}"):
        CALLS[call](g, make())


def test_torch_reduce_op_instead_of_tandem_one_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="tandem ReduceOp"):
        tandem.all_reduce(f(2), op="sum", group=g)  # type: ignore[arg-type]


def test_reduce_op_undefined_for_dtype_names_both(g) -> None:
    with pytest.raises(ArgumentError, match="BXOR.*torch.float32"):
        tandem.reduce_scatter_tensor(f(2), f(2 * P), op=tandem.ReduceOp.BXOR, group=g)


# -- roots ---------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda g: tandem.broadcast(f(2), src=P, group=g),
    lambda g: tandem.reduce(f(2), dst=-1, group=g),
    lambda g: tandem.gather(f(2), [f(2)] * P, dst=7, group=g),
    lambda g: tandem.scatter(f(2), None, src=P + 2, group=g),
], ids=["broadcast-src", "reduce-dst", "gather-dst", "scatter-src"])
def test_root_outside_the_group_is_named(g, call) -> None:
    with pytest.raises(ArgumentError, match=r"is not a member of group 'lonely' \(global ranks"):
        call(g)


@pytest.mark.parametrize("root", [1.5, "0", 2.0, True], ids=repr)
@pytest.mark.parametrize("name", ["src", "group_src"])
def test_a_root_that_is_not_an_int_is_named_as_such(g, name, root) -> None:
    with pytest.raises(ArgumentError, match=f"broadcast: {name} must be an int"):
        tandem.broadcast(f(2), group=g, **{name: root})


def test_a_root_given_as_a_numpy_or_torch_integer_is_taken(g) -> None:
    import numpy

    from tandem.collectives.checks import root_rank

    for root in (numpy.int64(g.ranks[2]), torch.tensor(g.ranks[2])):
        assert root_rank(g, "broadcast", root, None, "src") == 2
    for root in (numpy.int64(2), torch.tensor(2)):
        assert root_rank(g, "broadcast", None, root, "src") == 2


def test_group_src_outside_the_group_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"group_src=3 is outside \[0, 3\)"):
        tandem.broadcast(f(2), group=g, group_src=3)


# -- list lengths and dtypes --------------------------------------------------------------
def test_all_gather_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="tensor_list has 2 tensors; the group has 3 ranks"):
        tandem.all_gather([f(2), f(2)], f(2), group=g)


def test_all_gather_dtype_mismatch_is_named(g) -> None:
    outs = [f(2), f(2, dtype=torch.int64), f(2)]
    with pytest.raises(ArgumentError, match=r"tensor_list\[1\] is torch.int64, expected torch.float32"):
        tandem.all_gather(outs, f(2), group=g)


def test_all_gather_own_slot_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"tensor_list\[1\] has 3 elements, tensor has 2"):
        tandem.all_gather([f(2), f(3), f(2)], f(2), group=g)


def test_all_gather_into_tensor_output_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="must hold 3 x 2 elements of torch.float32, got 5"):
        tandem.all_gather_into_tensor(f(5), f(2), group=g)


def test_all_gather_into_tensor_dtype_mismatch_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="of torch.int32"):
        tandem.all_gather_into_tensor(f(6, dtype=torch.int32), f(2), group=g)


def test_gather_destination_without_list_is_told(g) -> None:
    with pytest.raises(ArgumentError, match="destination rank must pass gather_list"):
        tandem.gather(f(2), None, dst=1, group=g)


def test_gather_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="gather_list has 4 tensors"):
        tandem.gather(f(2), [f(2)] * 4, dst=1, group=g)


def test_gather_list_entry_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"gather_list\[2\] has 3 elements, tensor has 2"):
        tandem.gather(f(2), [f(2), f(2), f(3)], dst=1, group=g)


def test_scatter_list_entry_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"scatter_list\[1\] has 5 elements, tensor has 2"):
        tandem.scatter(f(2), [f(2), f(5), f(2)], src=1, group=g)


def test_all_to_all_own_slot_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"output_tensor_list\[1\] has 4 elements, "
                                            r"input_tensor_list\[1\] has 1"):
        tandem.all_to_all([f(1), f(4), f(1)], [f(1)] * P, group=g)


def test_scatter_source_without_list_is_told(g) -> None:
    with pytest.raises(ArgumentError, match="source rank must pass scatter_list"):
        tandem.scatter(f(2), None, src=1, group=g)


# A list on a rank that is not the root is never read or written: a caller expecting it
# filled (gather mistaken for all_gather) would find it untouched, so it is refused as
# torch refuses it. None or an empty list is fine.
def test_gather_list_on_a_rank_that_is_not_the_destination_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match=r"gather_list.*only on the destination.*dst=0.*"
                                            r"all_gather"):
        tandem.gather(f(2), [f(2)] * P, dst=0, group=g)


def test_scatter_list_on_a_rank_that_is_not_the_source_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match=r"scatter_list.*only on the source.*src=2"):
        tandem.scatter(f(2), [f(2)] * P, src=2, group=g)


def test_scatter_list_dtype_mismatch_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"scatter_list\[0\] is torch.float64"):
        tandem.scatter(f(2), [f(2, dtype=torch.float64)] * P, src=1, group=g)


def test_reduce_scatter_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="input_list has 1 tensors"):
        tandem.reduce_scatter(f(2), [f(2)], group=g)


def test_reduce_scatter_output_size_mismatch_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"input_list\[1\] has 4 elements, output has 2"):
        tandem.reduce_scatter(f(2), [f(4)] * P, group=g)


def test_reduce_scatter_tensor_input_of_wrong_size_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="input must hold 3 x 2 elements"):
        tandem.reduce_scatter_tensor(f(2), f(5), group=g)


def test_all_to_all_empty_input_list_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="input_tensor_list is empty"):
        tandem.all_to_all([f(1)] * P, [], group=g)


def test_all_to_all_output_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="output_tensor_list has 2 tensors"):
        tandem.all_to_all([f(1)] * 2, [f(1)] * P, group=g)


def test_all_to_all_dtype_mismatch_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"output_tensor_list\[0\] is torch.int8"):
        tandem.all_to_all([f(1, dtype=torch.int8)] * P, [f(1)] * P, group=g)


# -- all_to_all_single splits -------------------------------------------------------------
def test_uneven_splits_not_adding_up_to_the_rows_are_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"input_split_sizes=\[1, 1, 1\] must be 3 "
                                            r"non-negative sizes adding up to 4 rows"):
        tandem.all_to_all_single(f(3), f(4, 2), [1, 1, 1], [1, 1, 1], group=g)


def test_split_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match=r"output_split_sizes=\[1, 2\]"):
        tandem.all_to_all_single(f(3), f(3), [1, 2], None, group=g)


def test_negative_split_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="non-negative"):
        tandem.all_to_all_single(f(3), f(3), [1, 1, 1], [4, -1, 0], group=g)


def test_rows_not_divisible_without_splits_are_named(g) -> None:
    with pytest.raises(ArgumentError, match="input has 4 rows, not divisible by 3 ranks"):
        tandem.all_to_all_single(f(3), f(4), group=g)


def test_all_to_all_single_dtype_mismatch_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="output is torch.float32, input torch.int64"):
        tandem.all_to_all_single(f(3), f(3, dtype=torch.int64), group=g)


# -- point-to-point and barrier -------------------------------------------------------------
def test_send_to_itself_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="dst is this rank itself"):
        tandem.send(f(2), dst=1, group=g)


def test_send_without_destination_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="dst is required"):
        tandem.isend(f(2), group=g)


def test_recv_from_outside_the_group_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="src=9 is not a member"):
        tandem.irecv(f(2), src=9, group=g)


@pytest.mark.parametrize("name", ["send", "isend", "recv", "irecv"])
def test_a_p2p_error_names_the_function_called(g, name) -> None:
    peer = {"dst": 9} if "send" in name else {"src": 9}
    with pytest.raises(ArgumentError, match=rf"^{name}: (dst|src)=9 is not a member"):
        getattr(tandem, name)(f(2), group=g, **peer)


def test_non_contiguous_p2p_tensor_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="contiguous"):
        tandem.isend(f(4, 4).t(), dst=0, group=g)


def test_p2p_op_with_a_collective_is_refused() -> None:
    with pytest.raises(ArgumentError, match="isend or tandem.irecv"):
        tandem.P2POp(tandem.all_reduce, f(2), 0)  # type: ignore[arg-type]


def test_batch_isend_irecv_of_an_empty_list_is_refused() -> None:
    with pytest.raises(ArgumentError, match="non-empty list of P2POp"):
        tandem.batch_isend_irecv([])


def test_monitored_barrier_with_non_positive_timeout_is_refused(g) -> None:
    with pytest.raises(ArgumentError, match="timeout must be a finite, positive number"):
        tandem.monitored_barrier(group=g, timeout=0)


# -- objects --------------------------------------------------------------------------------
def test_all_gather_object_list_of_wrong_length_is_named(g) -> None:
    with pytest.raises(ArgumentError, match="object_list must be a list of 3"):
        tandem.all_gather_object([None], {"x": 1}, group=g)


def test_gather_object_destination_without_list_is_told(g) -> None:
    with pytest.raises(ArgumentError, match=r"destination \(rank 1\) must pass "
                                            r"object_gather_list, a list of 3; got None"):
        tandem.gather_object(1, None, dst=1, group=g)


def test_scatter_object_list_source_without_inputs_is_told(g) -> None:
    with pytest.raises(ArgumentError, match=r"source \(rank 1\) must pass "
                                            r"scatter_object_input_list, a list of 3; got None"):
        tandem.scatter_object_list([None], None, src=1, group=g)


def test_broadcast_object_list_needs_a_list(g) -> None:
    with pytest.raises(ArgumentError, match="object_list must be a list"):
        tandem.broadcast_object_list(("a",), src=1, group=g)  # type: ignore[arg-type]

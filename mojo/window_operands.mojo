"""The operands of one window launch: what window_ops.mojo receives from MAX, as the
pointers and shapes that window_launch.mojo checks and hands to the CPU path or a GPU
kernel.
"""

from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from std.utils import IndexList


struct WindowOperands[
    state_dtype: DType,
    written: MutOrigin = MutAnyOrigin,
    read: ImmOrigin = ImmutAnyOrigin,
](ImplicitlyCopyable):
    """The tensors of a verify, a verify with fold on load or a forward, each as its
    pointer and its shape (or length).

    Built as a forward's (no ring, no previous records), then `with_ring` for a verify
    and `with_previous` for a fold on load; a tree verify adds `with_parents` (and, for
    its fold on load, `with_previous_nodes`). An op without a ring or previous records
    holds the readout in the ring's place and the row table in the tables' places:
    pointers cannot be null, and neither the checks nor the kernels read what an op does
    not have.

    `written` and `read` are the origins of the pointers the op writes through and of
    those it only reads: Mojo keeps an AnyOrigin out of a field's type, so the struct
    takes them as parameters, and MAX's tensors give AnyOrigin pointers (the defaults).
    """

    comptime WrittenFloats = Pointer[Float32, Self.written]
    comptime WrittenState = Pointer[Scalar[Self.state_dtype], Self.written]
    comptime ReadFloats = Pointer[Float32, Self.read]
    comptime ReadIds = Pointer[UInt32, Self.read]
    comptime ReadNodes = Pointer[Int32, Self.read]

    var readout: Self.WrittenFloats
    var readout_dims: IndexList[2]
    var state: Self.WrittenState
    var state_dims: IndexList[4]
    var ring: Self.WrittenFloats
    var ring_dims: IndexList[4]
    var qkv: Self.ReadFloats
    var qkv_dims: IndexList[2]
    var decay: Self.ReadFloats
    # [T, nv, 1] for a decay per head (a [T, nv] tensor), [T, nv, K] per channel: one
    # shape that run_windows checks against CHANNEL.
    var decay_dims: IndexList[3]
    var beta: Self.ReadFloats
    var beta_dims: IndexList[2]
    var row_ids: Self.ReadIds
    var batch: Int  # the length of row_ids
    var ring_row_ids: Self.ReadIds
    var ring_row_ids_len: Int
    var offsets: Self.ReadIds
    var offsets_len: Int
    var previous_ring_row_ids: Self.ReadIds
    var previous_ring_row_ids_len: Int
    var previous_accepted: Self.ReadIds
    var previous_accepted_len: Int
    # A tree verify's tables, [batch, RING_LEN] each: every node's parent (signed: -1 is
    # the committed state) and, with fold on load, the previous step's accepted paths.
    var parents: Self.ReadNodes
    var parents_dims: IndexList[2]
    var previous_nodes: Self.ReadIds
    var previous_nodes_dims: IndexList[2]

    def __init__(
        out self,
        readout: OutputTensor[dtype=DType.float32, rank=2, ...],
        qkv: InputTensor[dtype=DType.float32, rank=2, ...],
        decay: InputTensor[dtype=DType.float32, ...],
        beta: InputTensor[dtype=DType.float32, rank=2, ...],
        recurrent_state: _MutableInputTensor[dtype=Self.state_dtype, rank=4, ...],
        row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    ):
        """A forward's operands; `decay` is [T, nv] (a decay per head) or [T, nv, K]."""
        comptime assert (
            Self.state_dtype == DType.float32 or Self.state_dtype == DType.bfloat16
        ), "recurrent_state must be float32 or bfloat16"
        comptime assert (
            decay.rank == 2 or decay.rank == 3
        ), "decay must be [T, nv] or [T, nv, K]"
        self.readout = rebind[Self.WrittenFloats](readout.unsafe_ptr())
        self.readout_dims = readout.shape()
        self.state = rebind[Self.WrittenState](recurrent_state.unsafe_ptr())
        self.state_dims = recurrent_state.shape()
        self.ring = rebind[Self.WrittenFloats](readout.unsafe_ptr())
        self.ring_dims = IndexList[4](0, 0, 1, 0)
        self.qkv = rebind[Self.ReadFloats](qkv.unsafe_ptr())
        self.qkv_dims = qkv.shape()
        self.decay = rebind[Self.ReadFloats](decay.unsafe_ptr())
        comptime if decay.rank == 2:
            self.decay_dims = IndexList[3](decay.dim_size(0), decay.dim_size(1), 1)
        else:
            self.decay_dims = IndexList[3](
                decay.dim_size(0), decay.dim_size(1), decay.dim_size(2)
            )
        self.beta = rebind[Self.ReadFloats](beta.unsafe_ptr())
        self.beta_dims = beta.shape()
        self.row_ids = rebind[Self.ReadIds](row_ids.unsafe_ptr())
        self.batch = row_ids.dim_size(0)
        self.ring_row_ids = self.row_ids
        self.ring_row_ids_len = self.batch
        self.offsets = rebind[Self.ReadIds](input_row_offsets.unsafe_ptr())
        self.offsets_len = input_row_offsets.dim_size(0)
        self.previous_ring_row_ids = self.row_ids
        self.previous_ring_row_ids_len = self.batch
        self.previous_accepted = self.row_ids
        self.previous_accepted_len = self.batch
        self.parents = Self.ReadNodes(unsafe_from_address=Int(self.row_ids))
        self.parents_dims = IndexList[2](0, 0)
        self.previous_nodes = self.row_ids
        self.previous_nodes_dims = IndexList[2](0, 0)

    def with_ring(
        self,
        ring: _MutableInputTensor[dtype=DType.float32, rank=4, ...],
        ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
    ) -> Self:
        """These operands with the ring a verify records into, and its row table."""
        var operands = self
        operands.ring = rebind[Self.WrittenFloats](ring.unsafe_ptr())
        operands.ring_dims = ring.shape()
        operands.ring_row_ids = rebind[Self.ReadIds](ring_row_ids.unsafe_ptr())
        operands.ring_row_ids_len = ring_row_ids.dim_size(0)
        return operands

    def with_previous(
        self,
        previous_ring_row_ids: InputTensor[dtype=DType.uint32, rank=1, ...],
        previous_num_accepted: InputTensor[dtype=DType.uint32, rank=1, ...],
    ) -> Self:
        """These operands with the previous step's ring rows and accepted counts, which
        a fold on load folds first."""
        var operands = self
        operands.previous_ring_row_ids = rebind[Self.ReadIds](
            previous_ring_row_ids.unsafe_ptr()
        )
        operands.previous_ring_row_ids_len = previous_ring_row_ids.dim_size(0)
        operands.previous_accepted = rebind[Self.ReadIds](
            previous_num_accepted.unsafe_ptr()
        )
        operands.previous_accepted_len = previous_num_accepted.dim_size(0)
        return operands

    def with_parents(
        self, parents: InputTensor[dtype=DType.int32, rank=2, ...]
    ) -> Self:
        """These operands with a tree verify's parents table ([batch, RING_LEN])."""
        var operands = self
        operands.parents = rebind[Self.ReadNodes](parents.unsafe_ptr())
        operands.parents_dims = parents.shape()
        return operands

    def with_previous_nodes(
        self, previous_accepted_nodes: InputTensor[dtype=DType.uint32, rank=2, ...]
    ) -> Self:
        """These operands with the previous step's accepted paths ([batch, RING_LEN]),
        whose records a tree verify's fold on load folds instead of the first ones."""
        var operands = self
        operands.previous_nodes = rebind[Self.ReadIds](previous_accepted_nodes.unsafe_ptr())
        operands.previous_nodes_dims = previous_accepted_nodes.shape()
        return operands

"""The analysis finds regions, fused-weight layouts, head, loss and vocab embeddings from
dataflow alone, on small captured graphs."""

from __future__ import annotations

import torch

from sptransform.graph.analysis import analyze
from sptransform.capture import FakeTemplate, capture
from sptransform.graph.placement import DimShard, whole
from tiny_models import SeqFirstLM, TinyConfig, TinyLM


def _analyze(model, inputs, tp=2):
    return analyze(capture(FakeTemplate(model, torch.device("cpu")), inputs, {}), tp)


def _ids(shape, vocab=61):
    return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)


def test_attention_and_mlp_regions_with_fused_kv_and_grouped_heads():
    config = TinyConfig(layers=2, hidden=32, heads=4, kv_heads=2, mlp="swiglu", ffn=64)
    analysis = _analyze(TinyLM(config), _ids((2, 8)))
    kinds = [(r.layer, r.kind) for r in analysis.regions]
    assert kinds == [(0, "attention"), (0, "mlp"), (1, "attention"), (1, "mlp")]
    attention, mlp = analysis.regions[:2]
    names = {attention.column_linears[c].weight_name: s for c, s in attention.columns.items()}
    assert names["blocks.0.attn.q.weight"] == whole(2, 32)
    # fused [k|v] with 2 K/V heads of 8: two segments, each split per head
    assert names["blocks.0.attn.kv.weight"] == DimShard(2, ((0, 16), (16, 16)))
    assert {mlp.column_linears[c].weight_name for c in mlp.columns} == {"blocks.0.mlp.up.weight", "blocks.0.mlp.gate.weight"}
    assert mlp.row.weight_name == "blocks.0.mlp.down.weight"
    assert analysis.seq_len == 8


def test_per_head_interleaved_qkv_needs_one_segment():
    analysis = _analyze(SeqFirstLM(TinyConfig(hidden=32, heads=4, ffn=64)), _ids((8, 2)))
    (spec,) = analysis.regions[0].columns.values()
    assert spec == whole(2, 96)


def test_head_loss_and_tied_embedding_are_found():
    analysis = _analyze(TinyLM(TinyConfig(tied=True)), _ids((2, 8)))
    assert analysis.head.weight_name == "head.weight"
    assert analysis.loss is not None
    assert [e.weight_name for e in analysis.vocab_embeddings] == ["head.weight"]


def test_position_embedding_of_vocab_size_is_not_vocab_parallel():
    config = TinyConfig(vocab=64, max_len=64, tied=False)  # positions table as big as the vocab
    analysis = _analyze(TinyLM(config), _ids((2, 8), vocab=64))
    assert [e.weight_name for e in analysis.vocab_embeddings] == ["tok.weight"]


def test_multihead_attentions_fused_in_proj_is_split_per_head_in_q_k_v_segments():
    """``nn.MultiheadAttention``: ``linear(x, in_proj_weight)``, ``unflatten(-1, [3, E])``, the heads
    merged with the batch (``view [S, B*H, D]``). The walk at tp=1 took the batch dim of 2 for the
    heads and the in_proj linear was left whole."""
    from models.encoders import TorchEncoder, inputs

    analysis = _analyze(TorchEncoder(), inputs())
    attention = [r for r in analysis.regions if r.kind == "attention"]
    assert len(attention) == 2
    (spec,) = attention[0].columns.values()
    assert spec == DimShard(2, ((0, 32), (32, 32), (64, 32)))  # [q|k|v], each split per head
    assert attention[0].row.weight_name == "enc.layers.0.self_attn.out_proj.weight"


def test_mla_up_projections_are_column_parallel_by_heads_and_the_low_rank_ones_replicated():
    """DeepSeek-V3's attention: q_a -> norm -> q_b; kv_a -> (latent | rope) -> norm -> kv_b -> (k_nope | v);
    the key assembled from k_nope and the shared rope part by writes into a ``new_empty`` buffer."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from sptransform.passes.canonicalize import functional_copies, remove_dead_code

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 64, (2, 8))
    captured = capture(FakeTemplate(model, torch.device("cpu")), (), dict(input_ids=ids, labels=ids))
    remove_dead_code(captured.gm), functional_copies(captured.gm)  # as the pass list runs them
    attention = analyze(captured, 2).regions[0]
    assert attention.kind == "attention" and attention.row.weight_name == "model.layers.0.self_attn.o_proj.weight"
    columns = {attention.column_linears[c].weight_name: s for c, s in attention.columns.items()}
    assert columns == {"model.layers.0.self_attn.q_b_proj.weight": whole(2, 32),  # 4 heads x (nope 4 + rope 4)
                       "model.layers.0.self_attn.kv_b_proj.weight": whole(3, 32)}  # 4 heads x (k_nope 4 + v 4)


def test_a_key_buffer_made_with_new_empty_from_a_split_tensor_keeps_the_attention_split():
    """``key = k_own.new_empty(...)`` reads the head-split ``k_own`` for its dtype only: no reader
    outside the region, so q / kv_b stay column-parallel and o row-parallel."""
    import sys
    from pathlib import Path

    from sptransform.passes.canonicalize import functional_copies, remove_dead_code

    sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
    import zoo

    model, inputs = zoo.build("buffer_key")
    captured = capture(FakeTemplate(model, torch.device("cpu")), inputs, {})
    remove_dead_code(captured.gm), functional_copies(captured.gm)
    attention = [r for r in analyze(captured, 2).regions if r.kind == "attention"]
    assert [r.row.weight_name for r in attention] == ["attn.0.o.weight", "attn.1.o.weight"]
    assert {attention[0].column_linears[c].weight_name for c in attention[0].columns} == {"attn.0.q.weight", "attn.0.kv_b.weight"}


class _MaxShiftedAttention(torch.nn.Module):
    """Scores minus each row's maximum (``max.dim``'s values) before the softmax, as attentions
    with sinks write it; a sink logit per head concatenated to the scores."""

    def __init__(self, hidden=32, heads=4, vocab=61):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, self.heads, self.dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2)
        scores = torch.cat([scores, self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = scores.softmax(-1)[..., :-1]
        y = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.head(x + self.o(y))


def test_an_attention_that_subtracts_the_row_maximum_is_split_by_heads():
    """The walk back from ``o`` passes ``max.dim`` (two outputs of one shape, split alike)."""
    from sptransform.passes.canonicalize import remove_dead_code

    captured = capture(FakeTemplate(_MaxShiftedAttention(), torch.device("cpu")), (torch.randint(0, 61, (2, 8)),), {})
    remove_dead_code(captured.gm)  # as the pipeline does: max.dim's unread indices
    attention = [r for r in analyze(captured, 2).regions if r.kind == "attention"]
    assert [r.row.weight_name for r in attention] == ["o.weight"]
    assert {attention[0].column_linears[c].weight_name for c in attention[0].columns} == {"q.weight", "k.weight", "v.weight"}


class _ExpertGroups(torch.nn.Module):
    """JetMoE's and ScatterMoE's way: the token-expert pairs sorted by expert, cut into one group of
    rows per expert with the counts ``.tolist()`` gives, each group through its expert, joined
    by ``cat``; the down projections on a second cut of the joined activations."""

    def __init__(self, experts=3, hidden=8, inner=16):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.up = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden))
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, inner))

    def forward(self, x):  # x: [tokens, hidden]
        choice = self.router(x).argmax(-1)
        order = choice.argsort(stable=True)
        counts = torch.nn.functional.one_hot(choice, self.up.shape[0]).sum(0).tolist()
        groups = x[order].split(counts)
        a = torch.cat([torch.nn.functional.linear(g, self.up[e]) for e, g in enumerate(groups)])
        gate, up = a.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        y = torch.cat([torch.nn.functional.linear(g, self.down[e]) for e, g in enumerate(a.split(counts))])
        return torch.zeros_like(x).index_add(0, order, y)


def test_experts_run_on_the_groups_of_one_split_form_one_block_with_a_row_linear_per_expert():
    """No walk back from one expert's down projection can carry a split past the ``split``, which
    needs every chunk's; walked together from all of them they form one block whose columns are
    every expert's up projection, the fused gate|up split in two segments."""
    analysis = _analyze(_ExpertGroups(), (torch.randn(16, 8),))
    assert len(analysis.regions) == 1
    region = analysis.regions[0]
    assert len(region.rows) == 3 and {r.weight_name for r in region.rows} == {"down"}
    assert {region.column_linears[c].weight_name for c in region.columns} == {"up"}
    assert set(region.columns.values()) == {DimShard(1, ((0, 16), (16, 16)))}
    split, = [n for n in region.specs if n.target is torch.ops.aten.split_with_sizes.default]
    assert region.specs[split] == whole(1, 16)  # the activations' cut: along the features, never the rows


def test_an_attention_whose_fused_projection_cannot_split_still_splits_its_heads_and_output_projection():
    """Falcon-7B: one fused linear makes the query heads and the single K/V head, K and V taken by
    an index beside the queries' slice. No split of the fused output serves both, so it is
    computed whole and the queries' slice cut to this rank's heads; the attention still runs on
    them and the output projection is row-parallel: a block with no column-parallel linear."""
    from models.zoo import FusedMultiQueryLM
    from sptransform.passes.canonicalize import sizes_as_arguments

    captured = capture(FakeTemplate(FusedMultiQueryLM(vocab=97, n_layer=1), torch.device("cpu")), _ids((2, 8), 97), {})
    sizes_as_arguments(captured.gm)  # k.expand_as(q): q's size as an argument, as the pass list does
    analysis = analyze(captured, 2)
    attention = next(r for r in analysis.regions if r.kind == "attention")
    assert attention.row.weight_name == "dense.0.weight" and not attention.columns
    (cut, spec), = attention.cuts
    assert cut.target is torch.ops.aten.slice.Tensor and spec == whole(2, 4)  # the 4 query heads
    assert "qkv.0.weight" in analysis.whole_reasons


def test_a_row_linear_fed_by_no_column_and_no_attention_stays_whole():
    """Without an attention between them, a row-parallel linear reading a cut of a whole tensor
    would only trade its weight's memory for two all-reduces: no block."""
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(61, 16)
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)

        def forward(self, ids, targets):
            h = self.a(self.emb(ids))  # a norm over the features: no split reaches ``a``
            return torch.nn.functional.mse_loss(self.b(torch.nn.functional.layer_norm(h, (16,))), h)

    analysis = _analyze(TwoLinears(), _ids((2, 8)))
    assert not analysis.regions and "b.weight" in analysis.whole_reasons


def test_einsum_with_a_parameter_is_a_linear_split_along_its_outermost_feature_letters():
    """``einsum("bsd,dnh->bnsh", x, W)``: input features ``d``, output features ``n, h`` (split by
    the heads ``n``, W's dim 1); ``"bnsh,nhd->bsd"`` contracts ``n, h`` (row-parallel along ``n``,
    W's dim 0). An expert-batched ``"etk,ekn->etn"`` (``e`` in both operands and the output) is
    not such a linear."""
    import torch.nn as nn

    class Einsums(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Parameter(torch.randn(16, 4, 4))
            self.wo = nn.Parameter(torch.randn(4, 4, 16))
            self.experts = nn.Parameter(torch.randn(2, 16, 16))

        def forward(self, x):
            q = torch.einsum("bsd,dnh->bnsh", x, self.wq)
            y = torch.einsum("bnsh,nhd->bsd", q.relu(), self.wo)
            return torch.einsum("etk,ekn->etn", y.expand(2, -1, -1, -1).flatten(1, 2), self.experts).sum()

    analysis = _analyze(Einsums(), (torch.randn(2, 3, 16),))
    by_weight = {lm.weight_name: lm for lm in analysis.linears.values()}
    assert set(by_weight) == {"wq", "wo"}
    wq, wo = by_weight["wq"], by_weight["wo"]
    assert (wq.out_dim, wq.weight_in_dim, wq.input_dim, wq.output_dim) == (1, 0, 2, 1)
    assert (wo.out_dim, wo.weight_in_dim, wo.input_dim, wo.output_dim) == (2, 0, 1, 2)
    (region,) = analysis.regions
    assert region.row is wo and set(region.columns) == {wq.node}


def test_a_per_head_projection_by_a_matrix_every_head_shares_runs_split_along_the_heads():
    """The zoo's ``token_taps`` attention: ``states [b, t, heads, d_rel] @ bank [d_rel, extent]``
    (a relative bias shared by the heads) is a linear the walk from the output projection needs
    split along the heads, a dim it maps row by row: it runs on each rank's heads with the bank
    whole, so the linear making ``states`` is a column of the attention block (before, the walk
    stopped there and the block's other linears ran whole too). The keys' and values' token-tap
    convolutions (``unfold`` + ``flip`` windows along time) keep the heads split. The bank's own
    block (``states`` as its column) shares that column and is dropped."""
    from models import zoo

    model, inputs = zoo.build("token_taps")
    analysis = _analyze(model, inputs)
    attention = [r for r in analysis.regions if r.kind == "attention"]
    assert len(attention) == 2
    columns = {attention[0].column_linears[c].weight_name for c in attention[0].columns}
    assert columns == {f"attn.0.{n}.weight" for n in ("q", "k", "v", "rel", "gate", "k_conv.taps", "v_conv.taps")}
    assert attention[0].row.weight_name == "attn.0.proj.weight"
    bank = [n for n in attention[0].specs if n in analysis.linears and analysis.linears[n].weight_name == "attn.0.bank"]
    assert len(bank) == 1 and bank[0] not in attention[0].columns
    assert "attn.0.bank" in analysis.whole_reasons and "per head" in analysis.whole_reasons["attn.0.bank"]

"""The validator's hand-written samples, part two (reductions, attention, embedding and
losses, convolution and pooling, einsum and routed experts), appended to
:data:`rule_samples.SAMPLES`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_samples import (
    WITH_4,
    Arg,
    B,
    Ints,
    N,
    Pos,
    _ignore,
    cap,
    direct,
    x0,
    x1,
    x2,
    x3,
)
from torch import nn

aten = torch.ops.aten

# ---------------------------------------------------------------- reductions
cap("sum_dims", lambda m, x: (x.sum((0, 2), keepdim=True), x.sum(1), x.sum()), N(2, 4, 6),
    meshes=WITH_4)
cap("mean_dims", lambda m, x: (x.mean(1, keepdim=True), x.mean((0, 2)), x.mean()), N(2, 4, 6))
direct("sum_default", aten.sum.default, [N(2, 4)], x0)
# a 0-d input reduces no dim (its mean over dim 0 raised IndexError in the lowering); a
# sum that casts to integers first keeps no Partial input
cap("reduce_0d", lambda m, x: (x.mean(0), x.sum(-1), x.cumsum(0), x.amax(0)), N())
direct("sum_dtype_int", aten.sum.dim_IntList, [N(4, 6)], x0, [1], dtype=torch.int64)
direct("mean_default", aten.mean.default, [N(2, 4)], x0)
cap("amax", lambda m, x: (x.amax(1), x.amax((0, 2), keepdim=True)), N(2, 4, 6))
direct("amin", aten.amin.default, [N(2, 4, 6)], x0, [1])
direct("argmax", aten.argmax.default, [N(2, 4, 6)], x0, 2, True)
direct("argmin", aten.argmin.default, [N(2, 4, 6)], x0, 0)
direct("cumsum", aten.cumsum.default, [N(2, 4, 6)], x0, 1)
direct("any_dim", aten.any.dim, [B(2, 4, 6)], x0, 1)
# non-linear reductions (rules/statistics.py): only the kept dims shard
cap("var_std", lambda m, x: (x.var(1), x.std((0, 2), keepdim=True, correction=0),
                             torch.var_mean(x, -1), torch.std_mean(x, 0, keepdim=True),
                             x.var(), x.std()), N(4, 8, 4), meshes=WITH_4)
direct("var_mean", aten.var_mean.correction, [N(4, 8, 4)], x0, [1], correction=2)
direct("std_mean", aten.std_mean.correction, [N(4, 8, 4)], x0, [0, 2], keepdim=True)
direct("var_dim", aten.var.dim, [N(4, 8, 4)], x0, [2], False, True)
direct("std_dim", aten.std.dim, [N(4, 8, 4)], x0, [0], True, False)
direct("var_default", aten.var.default, [N(4, 8)], x0)
direct("std_default", aten.std.default, [N(4, 8)], x0, False)
cap("logsumexp", lambda m, x: (x.logsumexp(1), x.logsumexp((0, 2), keepdim=True)), N(4, 8, 4),
    meshes=WITH_4)
cap("vector_norm", lambda m, x: (torch.linalg.vector_norm(x, dim=-1),
                                 torch.linalg.vector_norm(x, 1, (0, 1), keepdim=True),
                                 torch.linalg.vector_norm(x, float("inf"))), N(4, 8, 4),
    meshes=WITH_4)
direct("norm_scalar", aten.norm.Scalar, [N(4, 8)], x0, 3)
direct("norm_dim", aten.norm.ScalarOpt_dim, [N(4, 8, 4)], x0, 2, [1])
cap("max_min_dim", lambda m, x: (x.max(1), x.min(-1, keepdim=True), x.max(0)), N(4, 8, 4),
    meshes=WITH_4)
direct("all_dim", aten.all.dim, [B(2, 4, 6)], x0, 2, True)

# ---------------------------------------------------------------- attention
cap("sdpa", lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v), N(2, 4, 4, 8), N(2, 4, 6, 8),
    N(2, 4, 6, 8))
cap("sdpa_causal", lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    N(2, 2, 4, 8), N(2, 2, 4, 8), N(2, 2, 4, 8))
cap("sdpa_mask", lambda m, q, k, v, a: F.scaled_dot_product_attention(q, k, v, attn_mask=a),
    N(2, 2, 4, 8), N(2, 2, 4, 8), N(2, 2, 4, 8), N(2, 1, 4, 4))
cap("sdpa_gqa", lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    N(2, 4, 4, 8), N(2, 2, 4, 8), N(2, 2, 4, 8))
# the sequence split (context parallel): query rows, Ulysses (heads divide the CP degree)
# and ring attention (they do not: 2 heads on 4 ranks, GQA's 2 key/value heads on 4)
cap("sdpa_cp_causal", lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    N(2, 4, 8, 8), N(2, 4, 8, 8), N(2, 4, 8, 8), meshes=WITH_4)
cap("sdpa_cp_head_mask", lambda m, q, k, v, a: F.scaled_dot_product_attention(q, k, v, attn_mask=a),
    N(2, 4, 8, 8), N(2, 4, 8, 8), N(2, 4, 8, 8), N(2, 4, 8, 8), meshes=WITH_4)
cap("sdpa_cp_gqa_causal", lambda m, q, k, v: F.scaled_dot_product_attention(
    q, k, v, is_causal=True, enable_gqa=True, scale=0.3),
    N(1, 4, 8, 8), N(1, 2, 8, 8), N(1, 2, 8, 8), meshes=WITH_4)
cap("sdpa_cp_ring_odd", lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    N(1, 2, 12, 4), N(1, 2, 12, 4), N(1, 2, 12, 4), meshes=WITH_4)
# one node read as several of q, k, v: the strategy lists it once, so the rule's consumers
# must look placements up by node (before: sdpa(x, x, x) raised IndexError while
# planning, and sdpa(x, x, x, mask) lowered to query rows with k and v split: wrong values)
cap("sdpa_self_causal", lambda m, x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
    N(1, 4, 8, 4), meshes=WITH_4)
cap("sdpa_self_key_mask", lambda m, x, a: F.scaled_dot_product_attention(x, x, x, attn_mask=a),
    N(1, 4, 8, 4), N(1, 1, 1, 1), meshes=WITH_4)
cap("sdpa_shared_kv_mask", lambda m, q, kv, a: F.scaled_dot_product_attention(q, kv, kv, attn_mask=a),
    N(2, 4, 8, 4), N(2, 4, 8, 4), N(2, 4, 8, 8), meshes=WITH_4)

# ---------------------------------------------------------------- embedding and losses
cap("embedding", lambda m, i: m.e(i), Ints(8, 4, 6), e=nn.Embedding(8, 4), meshes=WITH_4)
# the padding row takes no gradient, also when the vocabulary is split (issue 64, cause
# 5: the vocab-parallel form dropped padding_idx); row 0 (BERT's pad id) and a row
# owned by the last of 4 ranks
cap("embedding_padding", lambda m, i: (m.e(i), m.g(i)), Ints(8, 4, 6), meshes=WITH_4,
    e=nn.Embedding(8, 4, padding_idx=0), g=nn.Embedding(8, 4, padding_idx=7),
    fix=lambda xs: (xs[0].__setitem__((0, 0), 0), xs[0].__setitem__((1, 1), 7)))
cap("embedding_freq", lambda m, i: F.embedding(i, m.e.weight, scale_grad_by_freq=True),
    Ints(8, 4, 6), e=nn.Embedding(8, 4), meshes=WITH_4)
cap("cross_entropy_mean", lambda m, x, t: F.cross_entropy(x, t), N(8, 6), Ints(6, 8),
    meshes=WITH_4, fix=_ignore(1, -100))
cap("cross_entropy_sum", lambda m, x, t: F.cross_entropy(x, t, reduction="sum", ignore_index=2),
    N(8, 4), Ints(4, 8), fix=_ignore(1, 2))
cap("cross_entropy_none", lambda m, x, t: F.cross_entropy(x, t, reduction="none"), N(8, 4),
    Ints(4, 8), fix=_ignore(1, -100))
cap("cross_entropy_3d", lambda m, x, t: F.cross_entropy(x, t), N(4, 6, 2), Ints(6, 4, 2),
    fix=_ignore(1, -100))
# probability targets (issue 64, cause 2: the row split divided by N x C, the class
# split crashed in gather); unbatched inputs, whose dim 0 is the classes
cap("cross_entropy_soft", lambda m, x, t: (F.cross_entropy(x, t),
                                          F.cross_entropy(x, t, reduction="sum"),
                                          F.cross_entropy(x, t, reduction="none")),
    N(8, 6), Pos(8, 6), meshes=WITH_4)
cap("cross_entropy_soft_3d", lambda m, x, t: F.cross_entropy(x, t), N(4, 6, 2), Pos(4, 6, 2))
cap("cross_entropy_unbatched", lambda m, x, t, p: (F.cross_entropy(x, t), F.cross_entropy(x, p)),
    N(8), Ints(8), Pos(8), meshes=WITH_4)
cap("cross_entropy_weight_smoothing", lambda m, x, t, w: (
    F.cross_entropy(x, t, weight=w), F.cross_entropy(x, t, label_smoothing=0.1)),
    N(8, 4), Ints(4, 8), Pos(4))
cap("mse_loss", lambda m, x, y: (F.mse_loss(x, y), F.mse_loss(x, y, reduction="sum"),
                                 F.mse_loss(x, y, reduction="none")), N(4, 6), N(4, 6),
    meshes=WITH_4)
direct("l1_loss", aten.l1_loss.default, [N(4, 6), N(4, 6)], x0, x1)
direct("l1_loss_sum", aten.l1_loss.default, [N(4, 6), N(4, 6)], x0, x1, 2)

# ---------------------------------------------------------------- convolution and pooling
cap("conv2d", lambda m, x: m.c(x), N(2, 4, 6, 6), c=nn.Conv2d(4, 2, 3, padding=1))
cap("conv2d_groups", lambda m, x: m.c(x), N(2, 4, 6, 6), c=nn.Conv2d(4, 4, 3, groups=2))
cap("conv1d", lambda m, x: m.c(x), N(2, 4, 8), c=nn.Conv1d(4, 2, 3, padding=1))
cap("pool2d", lambda m, x: (F.avg_pool2d(x, 2), F.max_pool2d(x, 2),
                            F.adaptive_avg_pool2d(x, (2, 2))), N(2, 4, 6, 6))
direct("max_pool2d", aten.max_pool2d.default, [N(2, 4, 6, 6)], x0, [2, 2])
direct("avg_pool1d", aten.avg_pool1d.default, [N(2, 4, 8)], x0, [2])
direct("max_pool1d", aten.max_pool1d.default, [N(2, 4, 8)], x0, [2])
# unbatched (C, H, W) / (C, L): dim 0 is the channel, dim 1 spatial
cap("conv2d_unbatched", lambda m, x: m.c(x), N(4, 6, 6), c=nn.Conv2d(4, 2, 3, padding=1),
    meshes=WITH_4)
cap("conv1d_unbatched", lambda m, x: m.c(x), N(4, 8), c=nn.Conv1d(4, 2, 3, padding=1))
cap("conv2d_unbatched_groups", lambda m, x: m.c(x), N(4, 6, 6), c=nn.Conv2d(4, 4, 3, groups=4))
cap("pool2d_unbatched", lambda m, x: (F.avg_pool2d(x, 2), F.max_pool2d(x, 2),
                                      F.adaptive_avg_pool2d(x, (2, 2))), N(4, 6, 6),
    meshes=WITH_4)
direct("avg_pool1d_unbatched", aten.avg_pool1d.default, [N(4, 8)], x0, [3], [1], [1])
direct("max_pool1d_unbatched", aten.max_pool1d.default, [N(4, 8)], x0, [3], [1], [1])
cap("conv2d_kwargs", lambda m, x: (m.c(x), F.conv2d(x, m.c.weight, padding="same")),
    N(2, 4, 8, 8), c=nn.Conv2d(4, 4, 3, stride=2, padding=2, dilation=2, bias=False))
cap("conv2d_depthwise", lambda m, x: m.c(x), N(2, 4, 6, 6), c=nn.Conv2d(4, 8, 3, groups=4),
    meshes=WITH_4)
cap("conv1d_groups_padding_same", lambda m, x: F.conv1d(x, m.c.weight, m.c.bias, 1, "same", 1, 2),
    N(2, 4, 8), c=nn.Conv1d(4, 4, 3, groups=2))
direct("conv1d_unbatched_same", aten.conv1d.padding, [N(4, 8), N(2, 4, 3)], x0, x1, None, [1], "same")
cap("conv3d", lambda m, x: m.c(x), N(2, 4, 4, 4, 4), c=nn.Conv3d(4, 2, 3, padding=1))
direct("conv3d_unbatched_same", aten.conv3d.padding, [N(4, 4, 4, 4), N(2, 2, 1, 3, 3), N(2)],
       x0, x1, x2, [1], "same", [1], 2)
cap("pool_indices", lambda m, x, y: (F.max_pool2d(x, 3, 1, 1, return_indices=True),
                                     F.max_pool1d(y, 2, return_indices=True),
                                     F.adaptive_max_pool2d(x, (2, 3)), F.adaptive_max_pool1d(y, 3),
                                     F.adaptive_max_pool2d(x, 1, return_indices=True)),
    N(2, 4, 6, 6), N(2, 4, 8), meshes=WITH_4)
direct("adaptive_max_pool2d_unbatched", aten.adaptive_max_pool2d.default, [N(4, 6, 6)], x0, [2, 2])
direct("max_pool2d_indices_unbatched", aten.max_pool2d_with_indices.default, [N(4, 6, 6)],
       x0, [3], [2], [1], [1], True)
cap("pool1d_3d", lambda m, x, z: (F.adaptive_avg_pool1d(x, 3), F.avg_pool3d(z, 2),
                                  F.max_pool3d(z, 3, 1, 1), F.adaptive_avg_pool3d(z, (1, 2, 1))),
    N(2, 4, 8), N(2, 4, 4, 4, 4))
cap("pool2d_kwargs", lambda m, x: (F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
                                   F.avg_pool2d(x, 2, divisor_override=3),
                                   F.max_pool2d(x, 2, 1, 0, dilation=2, ceil_mode=True)),
    N(2, 4, 7, 7))
# an integer average rounds each rank's part (no Partial)
direct("avg_pool2d_int", aten.avg_pool2d.default, [Ints(9, 2, 4, 4)], x0, [2])
direct("avg_pool1d_int", aten.avg_pool1d.default, [Ints(9, 4, 6)], x0, [3])
direct("avg_pool2d_unbatched_pad", aten.avg_pool2d.default, [N(4, 7, 7)], x0, [3], [2], [1],
       True, False)
cap("interpolate", lambda m, x, y, z: (
    F.interpolate(x, scale_factor=2), F.interpolate(x, size=(7, 9), mode="bilinear"),
    F.interpolate(x, size=(5, 5), mode="bilinear", align_corners=True),
    F.interpolate(x, scale_factor=1.5, mode="bicubic"), F.interpolate(x, size=(9, 7), mode="nearest-exact"),
    F.interpolate(y, scale_factor=2), F.interpolate(y, size=11, mode="linear"),
    F.interpolate(y, scale_factor=3, mode="nearest-exact"),
    F.interpolate(z, scale_factor=2), F.interpolate(z, size=(3, 5, 6), mode="trilinear")),
    N(2, 4, 6, 6), N(2, 4, 8), N(2, 4, 2, 4, 4), meshes=WITH_4)
for _op, _x, _extra in [
    (aten.upsample_nearest1d.default, N(2, 4, 5), ([9],)),
    (aten.upsample_linear1d.default, N(2, 4, 5), ([9], False)),
    (aten._upsample_nearest_exact1d.default, N(2, 4, 5), ([9],)),
    (aten.upsample_nearest2d.default, N(2, 4, 3, 5), ([6, 7],)),
    (aten.upsample_bilinear2d.default, N(2, 4, 3, 5), ([6, 7], True)),
    (aten.upsample_bicubic2d.default, N(2, 4, 3, 5), ([6, 7], False)),
    (aten._upsample_nearest_exact2d.default, N(2, 4, 3, 5), ([6, 7],)),
    (aten.upsample_nearest3d.default, N(2, 4, 2, 3, 2), ([3, 5, 4],)),
    (aten.upsample_trilinear3d.default, N(2, 4, 2, 3, 2), ([3, 5, 4], False)),
]:
    direct(str(_op), _op, [_x], x0, *_extra)

# ---------------------------------------------------------------- einsum and MoE routing
cap("einsum_moe", lambda m, d, x, w: torch.einsum(
    "gsec,egcm->gsm", d, torch.einsum("egcm,emh->egch", torch.einsum("gsec,gsm->egcm", d, x), w)),
    N(2, 4, 2, 2), N(2, 4, 6), N(2, 6, 6), meshes=WITH_4)
cap("einsum_forms", lambda m, x, y: (torch.einsum("ij,jk", x, y), torch.einsum("ij->i", x),
                                     torch.einsum("ij->ji", x), torch.einsum("ij,ij->i", x, x)),
    N(4, 6), N(6, 4))
direct("einsum_broadcast", aten.einsum.default, [N(2, 4, 6), N(1, 6, 2)], "bij,bjk->bik", [x0, x1])
direct("einsum_ellipsis", aten.einsum.default, [N(2, 4, 6), N(6, 2)], "...j,jk->...k", [x0, x1])
direct("topk", aten.topk.default, [N(2, 4, 6)], x0, 2)
direct("topk_dim1", aten.topk.default, [N(2, 4, 6)], x0, 3, 1, False)
direct("sort", aten.sort.default, [N(2, 4, 6)], x0, 1, True)
direct("sort_stable", aten.sort.stable, [N(2, 4, 6)], x0, stable=True, dim=0)
direct("argsort", aten.argsort.default, [N(2, 4, 6)], x0, -1)
direct("argsort_stable", aten.argsort.stable, [N(2, 4, 6)], x0, stable=True, dim=1)
direct("one_hot", aten.one_hot.default, [Ints(5, 4, 2)], x0, 5, meshes=WITH_4)
direct("one_hot_inferred", aten.one_hot.default, [Ints(5, 4, 2)], x0)
direct("gather", aten.gather.default, [N(2, 4, 6), Ints(6, 2, 4, 3)], x0, 2, x1)
direct("gather_short_index", aten.gather.default, [N(2, 4, 6), Ints(4, 2, 2, 6)], x0, 1, x1)
direct("scatter_add", aten.scatter_add.default, [N(2, 4, 6), Ints(6, 2, 4, 3), N(2, 4, 3)],
       x0, 2, x1, x2)
direct("scatter_add_short_src", aten.scatter_add.default, [N(4, 6), Ints(4, 2, 6), N(3, 6)],
       x0, 0, x1, x2)
for _red, _self in [("sum", True), ("mean", False), ("amax", True), ("prod", False)]:
    direct(f"scatter_reduce_{_red}", aten.scatter_reduce.two,
           [N(4, 8), Ints(8, 4, 4), N(4, 6)], x0, 1, x1, x2, _red, include_self=_self,
           meshes=WITH_4)
direct("scatter_reduce_mean_int", aten.scatter_reduce.two,
       [Ints(5, 4, 8), Ints(4, 4, 8), Ints(5, 4, 8)], x0, 0, x1, x2, "mean")
direct("scatter_reduce_sum_int", aten.scatter_reduce.two,
       [Ints(5, 4, 8), Ints(8, 4, 8), Ints(5, 4, 8)], x0, 1, x1, x2, "sum")
direct("index_select", aten.index_select.default, [N(2, 4, 6), Ints(4, 4)], x0, 1, x1)
# x[i0, i1] with broadcasting indices, as Hugging Face builds its masks
direct("index_tensor", aten.index.Tensor, [N(4, 16), Ints(4, 4, 1, 1, 1), Ints(16, 1, 1, 16, 1)],
       x0, [x1, x2])
direct("diff", aten.diff.default, [N(4, 6)], x0, 1, 1)
direct("diff_dim0_prepend", aten.diff.default, [N(4, 6), N(1, 6)], x0, 1, 0, x1)
direct("min_other", aten.min.other, [N(4, 6), N(4, 6)], x0, x1)
direct("max_other", aten.max.other, [N(4, 6), N(6)], x0, x1)
direct("where_scalar_other", aten.where.ScalarOther, [B(4, 6), N(4, 6)], x0, x1, 0.5)
direct("where_scalar_self", aten.where.ScalarSelf, [B(4, 6), N(4, 6)], x0, 0.5, x1)

# ---------------------------------------------------------------- routed experts (MoE)
# autopar::moe_experts (autopar/runtime/experts.py): tokens split, expert parallel (uneven
# all-to-alls on simulated ranks), experts split with a Partial output; routing spread
# over the experts, and skewed (every pair to expert 0: ranks receive nothing)
from autopar.runtime.experts import MOE_EXPERTS  # noqa: E402

_MOE = [N(8, 4), Ints(4, 8, 2), N(8, 2), N(4, 6, 4), N(4, 4, 3)]
direct("moe_experts", MOE_EXPERTS, _MOE, x0, x1, x2, x3, Arg(4), "silu", meshes=WITH_4)
direct("moe_experts_skewed", MOE_EXPERTS, [_MOE[0], Ints(1, 8, 2), *_MOE[2:]],
       x0, x1, x2, x3, Arg(4), "gelu_tanh", meshes=WITH_4)

# Registered ops no sample exercises, each with the reason why.  Empty: every rule
# registered today has a sample above; add an entry only with a real reason (e.g. the
# op cannot run on CPU), never to silence a failing rule.
SKIP: dict[object, str] = {}

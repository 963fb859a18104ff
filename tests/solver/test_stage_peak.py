"""The stage memory model's peak (autopar.search.stages.price.price_stage): the larger of
the backward's worst moment (activations not yet freed and the gradients made so far)
and the end of backward (every gradient and ZeRO-1/2's flat buckets), as
autopar.runtime.memstats measures it (tests/dist/test_parallelism_kinds.py holds the
two within 10% on real ranks).  Before, the model added every gradient to the
activation peak and ZeRO's buckets to both: 13-16% over what the ranks measured."""

from __future__ import annotations

import pytest

from autopar import MeshSpec
from autopar.plans.kinds import Schedule
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.price import price_stage
from autopar.search.stages.priced import Config

MESH = MeshSpec.preset("8xA100-nvlink", shape=(2,))
MIB = 2.0**20


def _layers(act: float, grad: float, n: int = 3) -> list[LayerStat]:
    # ``grad`` bytes of parameters replicated on the data-parallel axis per layer
    return [LayerStat(key=f"l{k}", seconds=0.01, forward=0.003, compute=0.01, activations=act,
                      out_bytes=act / 8, params=[ParamStat(grad, (0,), f"w{k}")]) for k in range(n)]


def _mem(layers, **cfg) -> dict[str, float]:
    # the gradient buffers freed each step, as these tests were written for (kept ones
    # are test_kept_buffers_hold_every_gradient_from_the_start's)
    c = Config(**{"keep_buffers": False, **cfg})
    return price_stage(layers, 0, c, MESH, lambda b: 0.0, float("inf"), "sgd", sync=False).memory


def test_kept_buffers_hold_every_gradient_from_the_start():
    # runtime/grad_sync.py keeps the buckets' buffers between steps where the memory
    # fits: every gradient it reduces exists at the forward's peak too (before, each
    # backward made new buffers: none at the forward, the peak below had no gradient)
    layers = _layers(act=100 * MIB, grad=10 * MIB)

    def priced(budget: float, **cfg):
        return price_stage(layers, 0, Config(**cfg), MESH, lambda b: 0.0, budget, "sgd", sync=False)

    kept = priced(float("inf"))
    assert kept.grad_buffers_kept
    assert kept.memory["activations"] == pytest.approx(300 * MIB)
    assert kept.memory["grads"] == pytest.approx(30 * MIB)
    freed = priced(float("inf"), keep_buffers=False)
    assert not freed.grad_buffers_kept and freed.memory["grads"] == 0.0
    # a budget between the two: the buffers are freed, nothing else changes
    tight = priced((kept.total_memory + freed.total_memory) / 2)
    assert not tight.grad_buffers_kept and tight.total_memory == pytest.approx(freed.total_memory)
    assert tight.recompute == freed.recompute == []
    # keep_grad_buffers=True keeps them whatever the budget
    assert priced(freed.total_memory, keep_buffers=True).grad_buffers_kept


def test_one_micro_batch_peaks_before_the_gradients_exist():
    # activations dominate: the peak is the last layer's backward, with no gradient
    # made yet; every layer's activations are alive
    m = _mem(_layers(act=100 * MIB, grad=10 * MIB))
    assert m["activations"] == pytest.approx(300 * MIB)
    assert m["grads"] == 0.0


def test_gradients_dominate_at_the_end_of_backward():
    # parameters dominate: the peak is the end of backward, every gradient and no activation
    m = _mem(_layers(act=1 * MIB, grad=50 * MIB))
    assert m["grads"] == pytest.approx(150 * MIB) and m["activations"] == 0.0


def test_the_sweep_finds_a_peak_inside_backward():
    # a large first layer's activations outlive the later layers' large gradients: the
    # worst moment is layer 0's backward (its 200 MiB and layers 1-2's 120 MiB of
    # gradients), above both the forward's end (220) and the end of backward (180)
    layers = _layers(act=10 * MIB, grad=60 * MIB)
    layers[0].activations = 200 * MIB
    m = _mem(layers)
    assert m["activations"] == pytest.approx(200 * MIB) and m["grads"] == pytest.approx(120 * MIB)


@pytest.mark.parametrize("schedule,present", [(Schedule.ONE_F_ONE_B, True), (Schedule.GPIPE, False)])
def test_earlier_micro_batches_gradients(schedule, present):
    # under accumulation and 1F1B a later micro-batch's forward meets the gradients of
    # the earlier ones; GPipe runs every forward before the first backward
    layers = _layers(act=100 * MIB, grad=10 * MIB)
    m = _mem(layers, stages=2, micro_batches=4, schedule=schedule.value)
    assert m["grads"] == (pytest.approx(30 * MIB) if present else 0.0)
    acc = _mem(layers, micro_batches=4)
    assert acc["grads"] == pytest.approx(30 * MIB)


def test_zero2_flat_buckets_at_the_end_of_backward():
    # 3 x 6 MiB of gradients: buckets of >= 4 MiB close after each parameter, so the
    # end of backward holds the sharded gradients (9 MiB over 2 ranks), the previous
    # bucket's flat copy and the current one's flat and whole gradients (3 x 6 MiB)
    m = _mem(_layers(act=1 * MIB, grad=6 * MIB), zero_stage=2, zero_axis=0)
    assert m["grads"] == pytest.approx(9 * MIB)
    assert m["transient"] == pytest.approx(18 * MIB)


def test_the_largest_gradient_waits_beside_its_bucket():
    # runtime/grad_sync.py copies each gradient into its bucket (then .grad is a view of
    # it): the largest one exists twice for a moment, at the end of backward at worst
    m = _mem(_layers(act=1 * MIB, grad=40 * MIB))
    assert m["grads"] == pytest.approx(120 * MIB) and m["transient"] == pytest.approx(40 * MIB)

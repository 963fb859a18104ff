"""The cluster presets :meth:`MeshSpec.preset <autopar.cost_models.mesh.MeshSpec.preset>`
knows, and how a preset's node description gives every mesh axis its link."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .link import LinkSpec


@dataclass(frozen=True)
class _NodePreset:
    """A cluster description from which per-axis links are derived for any mesh shape."""

    gpus_per_node: int | None  # None: one host with no node boundary
    intra: LinkSpec
    inter: LinkSpec | None  # None: a single node, shapes larger than a node are rejected
    peak_flops: float
    mem_bandwidth: float
    mem_capacity: float
    default_shape: tuple[int, ...]
    kernel_floor: float = 5e-6
    hint: str = ""
    overlap: float = 1.0
    fp32_peak_flops: float | None = None
    reserve_bytes: float = 0.0
    reserve_fraction: float = 0.0
    flat_ring: tuple[str, ...] = ()
    split_backward: float = 1.0
    host_bandwidth: float | None = None
    host_memory: float | None = None
    host_mem_bandwidth: float | None = None


_GIB = 2**30
# NCCL runs all-gather and reduce-scatter only as rings over every rank of the group (no
# tree, no hierarchical split), one ring per channel so each node's NICs each carry one:
# a group spanning nodes is paced by the inter-node link at the node's bandwidth, for
# every rank's share, not by an ideal two-level composition (MeshSpec.flat_ring).
# All-reduce stays hierarchical: NCCL's tree and ring all-reduce keep about that cost.
_NCCL_FLAT = ("all_gather", "reduce_scatter")
# What a GPU spends outside the plan's tensors (MeshSpec.reserve_bytes/reserve_fraction):
# the CUDA context and cuBLAS/cuDNN workspaces (0.5-1 GiB per process with torch), NCCL's
# buffers (a few hundred MiB per communicator, several communicators per mesh), and the
# caching allocator's fragmentation, which grows with the memory in use (a few percent of
# it in long training runs): 1.5 GiB plus 5% of the device.
_GPU_RESERVE = {"reserve_bytes": 1.5 * _GIB, "reserve_fraction": 0.05}
# NVLink numbers are effective per-direction bandwidth per GPU (A100 NVLink3 600 GB/s
# bidirectional -> ~300e9; H100 NVLink4 900 GB/s -> ~450e9). InfiniBand is one HDR (200 Gb/s,
# 25e9 B/s) or NDR (400 Gb/s, 50e9 B/s) NIC per GPU. GPU peak_flops is the dense bf16
# tensor-core peak, since that is the dtype large models train in, and fp32_peak_flops the
# dense fp32 peak without tensor cores: PyTorch keeps TF32 off for matmuls by default
# (torch.backends.cuda.matmul.allow_tf32 = False), so an fp32 model runs at that rate.
# cpu-gloo has one rate for every dtype.
_NVLINK_A100 = LinkSpec(alpha=5e-6, beta=300e9)
_NVLINK_H100 = LinkSpec(alpha=5e-6, beta=450e9)
_IB_HDR = LinkSpec(alpha=1e-5, beta=25e9)
_IB_NDR = LinkSpec(alpha=1e-5, beta=50e9)
# Host memory for offload (MeshSpec.host_*), per GPU of an 8-GPU node: the node's RAM less
# 10% for the processes and the OS, over its GPUs (DGX A100 1 TiB, DGX H100 2 TiB,
# p3.16xlarge 488 GiB; the 40 GB A100 nodes of Mist's runs taken as DGX A100); a GPU's
# share of its PCIe link each way (PCIe 4.0 x16 ~25 GB/s and 5.0 ~50 GB/s measured with
# pinned buffers, halved: two GPUs share a switch's uplink with the NICs; V100's PCIe 3.0
# ~12 GB/s halved), and the two sockets' memory bandwidth over the GPUs (DGX A100 2 x 8
# DDR4-3200 channels ~410 GB/s, DGX H100 2 x 8 DDR5-4800 ~610 GB/s, p3's 2 x 6 DDR4-2666
# ~250 GB/s).  Not measured here: no GPU node has run the offload benchmark yet.
_HOST_A100 = {"host_bandwidth": 12.5e9, "host_memory": 0.9 * 1024 * _GIB / 8, "host_mem_bandwidth": 410e9 / 8}
_HOST_H100 = {"host_bandwidth": 25e9, "host_memory": 0.9 * 2048 * _GIB / 8, "host_mem_bandwidth": 610e9 / 8}
_HOST_V100 = {"host_bandwidth": 6e9, "host_memory": 0.9 * 488 * _GIB / 8, "host_mem_bandwidth": 250e9 / 8}
_A100 = {"peak_flops": 312e12, "fp32_peak_flops": 19.5e12, "mem_bandwidth": 2.039e12,
         "mem_capacity": 80.0 * _GIB, "flat_ring": _NCCL_FLAT, **_GPU_RESERVE, **_HOST_A100}
_H100 = {"peak_flops": 989e12, "fp32_peak_flops": 67e12, "mem_bandwidth": 3.35e12,
         "mem_capacity": 80.0 * _GIB, "flat_ring": _NCCL_FLAT, **_GPU_RESERVE, **_HOST_H100}

# AWS p3.16xlarge (Alpa's OSDI'22 testbed): 8 V100-SXM2 16 GB on NVLink2 in a hybrid cube
# mesh (6 links of 25 GB/s per GPU, not all-to-all: NCCL rings reach ~130 GB/s bus
# bandwidth), one 25 Gb/s Ethernet NIC per node, i.e. 25e9/8/8 B/s per GPU when the
# node's 8 GPUs all cross it (what a data-parallel or pipeline axis over nodes does).
# V100 has no bf16: its tensor-core peak (125 TFLOP/s) is fp16's, which a
# "bf16-mixed" plan stands for here (the same bytes per element).
_NVLINK_V100 = LinkSpec(alpha=5e-6, beta=130e9)
_ETH_25G_PER_GPU = LinkSpec(alpha=5e-5, beta=25e9 / 8 / 8)
_V100_16G = {"peak_flops": 125e12, "fp32_peak_flops": 15.7e12, "mem_bandwidth": 900e9,
             "mem_capacity": 16.0 * _GIB, "flat_ring": _NCCL_FLAT, **_GPU_RESERVE, **_HOST_V100}
# A100-SXM4 40 GB nodes as in Mist's EuroSys'25 runs: NVLink3 inside a node; between nodes
# Mist's own profile (github Dazz993/Mist, tools/results-final/bandwidth-*-a100-sxm4-40gb)
# measured ~10.7 GB/s all-gather with 8 GPUs per node on 2 and 4 nodes: 10.7e9/8 B/s
# per GPU (the paper's NIC is not in any text this project could read).
_XNODE_A100_40G = LinkSpec(alpha=1e-5, beta=10.7e9 / 8)
_A100_40G = {**_A100, "mem_capacity": 40.0 * _GIB}

_PRESETS: dict[str, _NodePreset] = {
    "8xA100-nvlink": _NodePreset(8, _NVLINK_A100, None, default_shape=(8,),
                                 hint="use 'multinode-a100-ib' for more than one node", **_A100),
    "8xH100-nvlink": _NodePreset(8, _NVLINK_H100, None, default_shape=(8,),
                                 hint="use 'multinode-h100-ib' for more than one node", **_H100),
    "multinode-a100-ib": _NodePreset(8, _NVLINK_A100, _IB_HDR, default_shape=(4, 8), **_A100),
    "multinode-h100-ib": _NodePreset(8, _NVLINK_H100, _IB_NDR, default_shape=(4, 8), **_H100),
    "p3.16xlarge": _NodePreset(8, _NVLINK_V100, _ETH_25G_PER_GPU, default_shape=(8, 8), **_V100_16G),
    "multinode-a100-40gb": _NodePreset(8, _NVLINK_A100, _XNODE_A100_40G, default_shape=(4, 8),
                                       **_A100_40G),
    # One CPU host running gloo over loopback: every rank is on the same host, so there is no
    # node boundary. Numbers are deliberately modest (a few cores per rank, fp32). The link
    # is optimistic for a 2-core machine (about 0.5 ms per ring hop and 1 GB/s there): at
    # that latency the planner would gather the logits to skip the loss's reductions, a
    # choice `autopar check` should confirm on the job first; calibrate() measures the real
    # link. A collective keeps 0.35 of its speed while the ranks compute (MeshSpec.overlap).
    # gloo's reduce-scatter is an all-reduce followed by a local slice (2(p-1)/p of the
    # bytes and 2(p-1) latencies, 1-2x an all-reduce of the same input on this host), so
    # it has its own (alpha, beta).
    # Reserve: a rank's interpreter, torch and gloo take 0.3-0.5 GiB before any tensor.
    # gloo runs a collective over a group spanning several mesh axes as one flat
    # algorithm over its ranks, with no notion of levels (flat_ring): a data-parallel
    # gradient bucket on a 2x2 mesh costs what it costs on 4 ranks in a row.
    "cpu-gloo": _NodePreset(None, LinkSpec(alpha=5e-5, beta=2e9,
                                           kinds=(("reduce_scatter", 1e-4, 1e9),)), None, peak_flops=5e10,
                            mem_bandwidth=1e10, mem_capacity=8.0 * _GIB, default_shape=(2,),
                            kernel_floor=1e-5, overlap=0.35, reserve_bytes=0.5 * _GIB,
                            split_backward=1.15, flat_ring=("all_reduce", "all_gather", "reduce_scatter"),
                            # a rank's host memory is its device memory: offload moves state
                            # within the same RAM (forced, to test it; the search never gains)
                            host_memory=8.0 * _GIB),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
"""Names accepted by :meth:`MeshSpec.preset`."""


def _derive_links(
    shape: tuple[int, ...], gpus_per_node: int | None, intra: LinkSpec, inter: LinkSpec | None,
    where: str,
) -> tuple[LinkSpec, ...]:
    """Assign a link to every axis, walking from the last (fastest-varying) axis backwards.

    While the product of trailing axes fits in a node the axis is intra-node; an axis whose
    stride already covers a whole node is entirely inter-node; an axis in between straddles and
    gets a hierarchical link with ``group`` = members of the axis that share a node.
    """
    total = math.prod(shape)
    if gpus_per_node is None:
        return tuple(intra for _ in shape)
    if inter is None and total > gpus_per_node:
        raise ValueError(
            f"{where} is one node of {gpus_per_node} devices but shape {shape} has {total}"
        )
    links: list[LinkSpec] = []
    inner = 1  # product of the axes already assigned (the stride of the current axis)
    for size in reversed(shape):
        if inner * size <= gpus_per_node:
            links.append(intra)
        elif inner >= gpus_per_node:
            assert inter is not None  # total > gpus_per_node was rejected above
            links.append(inter)
        else:
            assert inter is not None
            # gcd keeps the model well defined when the layout does not tile nodes evenly
            # (e.g. 12 ranks on 8-GPU nodes); it then under-counts in-node members, which
            # errs toward a slower, safer estimate.
            group = math.gcd(size, gpus_per_node // inner)
            links.append(inter if group == 1 else replace(intra, inter=inter, group=group))
        inner *= size
    return tuple(reversed(links))


__all__ = ["PRESET_NAMES"]

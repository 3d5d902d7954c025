"""The scenarios tests/test_distributed.py runs in each of its 2 gloo ranks: collectives and
point-to-point transfers on OffloadedTensors, tensor parallelism with DTensor (a transformers Llama
and the reference DeepSeek) and by hand (Megatron-style), FSDP2 in either order (with peft LoRA too)
and the seed at TP=2. Each returns a record of what its rank saw; the checks on those records are
test_distributed.py's. No tests here."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD = 2
GiB = 2 ** 30


# ---------------------------------------------------------------------------- scenarios (run in each rank)


def _collectives(rank: int) -> dict:
    import offtensor as ot

    def off(values):
        return ot.offload(torch.as_tensor(values, dtype=torch.float32), device="cpu")

    r = {}
    t = off([float(rank)] * 4)
    _ = t + 0  # a cached device copy exists: the collective must invalidate it
    dist.broadcast(t, src=0)
    r["broadcast"] = (type(t).__name__, t.cpu().tolist(), (t + 0).tolist())
    t = off([rank + 1.0] * 4)
    dist.all_reduce(t)
    r["all_reduce"] = t.cpu().tolist()
    t = off([rank + 1.0] * 2)
    dist.all_reduce(t, async_op=True).wait()
    r["all_reduce_async"] = t.cpu().tolist()
    outs = [off([0.0, 0.0]) for _ in range(WORLD)]
    dist.all_gather(outs, off([float(rank)] * 2))  # Tensor[][] outputs
    r["all_gather"] = [o.cpu().tolist() for o in outs]
    out = off([0.0, 0.0])
    dist.scatter(out, [off([10.0 + i] * 2) for i in range(WORLD)] if rank == 0 else None, src=0)  # Tensor[][] inputs
    r["scatter"] = out.cpu().tolist()
    out = off([0.0] * 4)
    dist.all_gather_into_tensor(out, off([float(rank)] * 2))
    r["all_gather_into_tensor"] = out.cpu().tolist()
    t = off([float(rank)] * 3)
    if rank == 0:
        dist.send(off([7.0] * 3), 1)
    else:
        dist.recv(t, 0)
    r["send_recv"] = t.cpu().tolist()
    # OffloadedTensors only inside a Tensor[][] (every flat argument plain): the dispatcher never
    # shows them to __torch_dispatch__; offtensor's BackendSelect kernel finds them, in inference
    # mode too (where the autograd keys are excluded).
    for mode, ctx in (("nested", torch.enable_grad), ("nested_inference", torch.inference_mode)):
        with ctx():
            out = torch.zeros(2)
            dist.scatter(out, [off([20.0 + i] * 2) for i in range(WORLD)] if rank == 0 else None, src=0)
            outs = [off([0.0, 0.0]) for _ in range(WORLD)]
            dist.all_gather(outs, torch.full((2,), rank + 3.0))
            gathered = [off([0.0, 0.0]) for _ in range(WORLD)] if rank == 1 else None
            dist.gather(torch.full((2,), rank + 5.0), gathered, dst=1)
            r[mode] = (out.tolist(), [o.cpu().tolist() for o in outs],
                       None if gathered is None else [(type(g).__name__, g.cpu().tolist()) for g in gathered])
    import torch.distributed._functional_collectives as fc

    r["functional_all_reduce"] = fc.all_reduce(off([rank + 1.0] * 2), "sum", dist.group.WORLD).tolist()
    t = off([rank + 1.0] * 2)
    torch.ops._c10d_functional.all_reduce_(t, "sum", dist.group.WORLD.group_name)
    r["functional_all_reduce_"] = t.cpu().tolist()
    return r


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _llama_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def _offloaded_leaves(model):
    from offtensor import leaves
    from offtensor.tensor import OffloadedTensor

    found = {}
    for name, p in model.named_parameters():
        for leaf in leaves.leaf_tensors(p):
            if isinstance(leaf, OffloadedTensor):
                found[name] = leaf
    return found


def _llama_tp(rank: int, mesh) -> dict:
    import offtensor as ot
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    reference = parallelize_module(_llama(), mesh, _llama_plan())
    with torch.no_grad():
        ref_logits = reference(ids).logits
    ref_tokens = reference.generate(ids, max_new_tokens=4, do_sample=False)
    full_down = _llama().model.layers[0].mlp.down_proj.weight.detach()

    model = parallelize_module(_llama(), mesh, _llama_plan())
    down = model.model.layers[0].mlp.down_proj.weight
    budget = 0.1 / 1024  # GiB per rank: about half of this rank's 214 KB of weights stay resident
    ot.wrap_model(model, budget_gb=budget, device="cpu")
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    s = ot.stats(model)
    offloaded = _offloaded_leaves(model)
    sharded = {n: t for n, t in offloaded.items() if isinstance(model.get_parameter(n), DTensor)}
    return {
        "logits_equal": torch.equal(logits, ref_logits), "tokens_equal": torch.equal(tokens, ref_tokens),
        "same_parameter": model.model.layers[0].mlp.down_proj.weight is down, "outer_class": type(down).__name__,
        "offloaded_bytes": s.offloaded_bytes, "peak": s.peak_device_bytes, "budget": s.budget_bytes,
        "resident_bytes": s.resident_bytes,
        "master_bytes": sum({id(t._master): t._master.nbytes for t in offloaded.values()}.values()),
        # each rank's masters hold its shard only: every sharded weight's master is its local shard's size
        "shard_masters": all(t._master.nbytes == t.numel() * t.element_size() == model.get_parameter(n).to_local().numel()
                             * t.element_size() for n, t in sharded.items()),
        "sharded_offloaded": len(sharded),
        "full_tensor_equal": torch.equal(down.full_tensor(), full_down),
    }


def _llama_wrap_then_parallelize(rank: int, mesh) -> dict:
    import offtensor as ot
    from torch.distributed.tensor.parallel import parallelize_module

    model = _llama()
    ot.wrap_model(model, budget_gb=0.2 / 1024, device="cpu")
    from torch.distributed.tensor import DTensor

    try:
        parallelize_module(model, mesh, _llama_plan())
    except RuntimeError as e:
        error = str(e)
    else:
        error = None
    return {"error": error, "dtensors": sum(isinstance(p, DTensor) for p in model.parameters())}


def _deepseek_config():
    from offtensor.models.deepseek import DeepSeekConfig

    return DeepSeekConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                          moe_intermediate_size=64, intermediate_size=128, tie_word_embeddings=True)


def _deepseek_tp_model(mesh):
    """The reference DeepSeek with a TP plan: attention heads split across ranks (q_proj and
    kv_b_proj by columns, o_proj by rows), the dense MLP and the shared experts Megatron-style;
    router, routed experts, norms and the tied embedding replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from offtensor.models.deepseek import DeepSeekForCausalLM

    model = DeepSeekForCausalLM(_deepseek_config()).init_weights(seed=0).eval()
    plan = {}
    for i, layer in enumerate(model.layers):
        for name in ("q_proj", "kv_b_proj"):
            plan[f"layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        mlp = f"layers.{i}.mlp" + (".shared_experts" if hasattr(layer.mlp, "experts") else "")
        plan[f"{mlp}.gate_proj"] = ColwiseParallel()
        plan[f"{mlp}.up_proj"] = ColwiseParallel()
        plan[f"{mlp}.down_proj"] = RowwiseParallel()
        layer.self_attn.num_heads //= WORLD  # this rank's heads
    return parallelize_module(model, mesh, plan)


def _deepseek_tp(rank: int, mesh) -> dict:
    import offtensor as ot

    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    reference = _deepseek_tp_model(mesh)
    ref_tokens = reference.generate(ids, max_new_tokens=4)
    model = _deepseek_tp_model(mesh)
    ot.wrap_model(model, offload_gb=0.15 / 1024, device="cpu")  # per rank, as vLLM's cpu_offload_gb
    tokens = model.generate(ids, max_new_tokens=4)
    s = ot.stats(model)
    return {"tokens_equal": torch.equal(tokens, ref_tokens), "offloaded_bytes": s.offloaded_bytes,
            "peak": s.peak_device_bytes, "budget": s.budget_bytes,
            "tied": model.lm_head.weight is model.embed_tokens.weight}


def _manual_tp(rank: int) -> dict:
    """Megatron-style TP by hand: plain nn.Linear shards, all_reduce after the row-parallel layer."""
    import offtensor as ot

    class ShardedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            up, down = nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False)
            half = 256 // WORLD
            self.up = nn.Linear(64, half, bias=False)
            self.down = nn.Linear(half, 64, bias=False)
            with torch.no_grad():
                self.up.weight.copy_(up.weight[rank * half:(rank + 1) * half])
                self.down.weight.copy_(down.weight[:, rank * half:(rank + 1) * half])

        def forward(self, x):
            y = self.down(F.silu(self.up(x)))
            dist.all_reduce(y)
            return y

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    reference = ShardedMLP()(x)
    model = ShardedMLP()
    ot.wrap_model(model, offload_gb=32768 / GiB, device="cpu")
    out = model(x)
    s = ot.stats(model)
    return {"equal": torch.equal(out, reference), "offloaded_bytes": s.offloaded_bytes, "peak": s.peak_device_bytes,
            "budget": s.budget_bytes}


class _Lora(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(64, 64, bias=False)
        self.base.weight.requires_grad_(False)
        self.A = nn.Linear(64, 4, bias=False)
        self.B = nn.Linear(4, 64, bias=False)
        nn.init.normal_(self.B.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x))


class _LoraNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = _Lora(), _Lora()

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


_LORA_POLICY = {"offload": ["*.base.*"], "keep": ["*.A.*", "*.B.*"]}


_LORA_BUDGET_GB = 24000 / GiB


def _adamw_losses(model, rank: int, steps: int = 3) -> list:
    """The losses of ``steps`` AdamW steps on ``model``'s trainable parameters, on this rank's seeded
    inputs: the same run for a wrapped model and its unwrapped reference."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 64, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _lora_fsdp_run(rank: int, mesh, wrap: bool, wrap_first: bool = True):
    import offtensor as ot
    from torch.distributed.fsdp import fully_shard

    model = _LoraNet()
    frozen = {p for n, p in model.named_parameters() if ".base." in n}
    if wrap and wrap_first:
        ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=_LORA_POLICY, device="cpu")
    fully_shard(model, mesh=mesh, ignored_params=frozen)
    if wrap and not wrap_first:
        ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=_LORA_POLICY, device="cpu")
    losses = _adamw_losses(model, rank)
    adapters = [p.full_tensor() for p in model.parameters() if p.requires_grad]
    return model, losses, adapters


def _fsdp(rank: int, mesh) -> dict:
    import offtensor as ot
    from offtensor.tensor import OffloadedTensor
    from torch.distributed.fsdp import fully_shard

    _, ref_losses, ref_adapters = _lora_fsdp_run(rank, mesh, wrap=False)
    model, losses, adapters = _lora_fsdp_run(rank, mesh, wrap=True)
    s = ot.stats(model)
    r = {"losses_equal": losses == ref_losses, "adapters_equal": all(map(torch.equal, adapters, ref_adapters)),
         "base_offloaded": isinstance(model.l1.base.weight, OffloadedTensor), "offloaded_bytes": s.offloaded_bytes,
         "peak": s.peak_device_bytes, "budget": s.budget_bytes}
    model = _LoraNet()
    ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=_LORA_POLICY, device="cpu")
    try:
        fully_shard(model, mesh=mesh)  # the offloaded base too
        r["refusal"] = None
    except RuntimeError as e:
        r["refusal"] = str(e)
    r["base_still_offloaded"] = isinstance(model.l1.base.weight, OffloadedTensor)
    return r


def _fsdp_then_wrap(rank: int, mesh) -> dict:
    """The other order: fully_shard first, then a wrap that offloads the frozen base FSDP2 was told
    to ignore (works), and one that would offload a weight FSDP2 shards (refused)."""
    import offtensor as ot
    from offtensor.model.copies import is_wrapped
    from offtensor.tensor import OffloadedTensor
    from torch.distributed.fsdp import fully_shard

    _, ref_losses, ref_adapters = _lora_fsdp_run(rank, mesh, wrap=False)
    model, losses, adapters = _lora_fsdp_run(rank, mesh, wrap=True, wrap_first=False)
    r = {"losses_equal": losses == ref_losses, "adapters_equal": all(map(torch.equal, adapters, ref_adapters)),
         "base_offloaded": isinstance(model.l1.base.weight, OffloadedTensor),
         "offloaded_bytes": ot.stats(model).offloaded_bytes}
    model = _LoraNet()
    fully_shard(model, mesh=mesh)  # the base too
    try:
        ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=_LORA_POLICY, device="cpu")
        r["refusal"] = None
    except RuntimeError as e:
        r["refusal"] = str(e)
    r["offloaded_leaves"] = sum(isinstance(leaf, OffloadedTensor) for p in model.parameters()
                                for leaf in (p._local_tensor, p))
    r["wrapped"] = is_wrapped(model)
    # the refused model trains as the unwrapped FSDP2 model does
    after = _adamw_losses(model, rank)
    _, sharded_losses, _ = _fsdp_all_sharded_reference(rank, mesh)
    r["refused_model_trains_as_unwrapped"] = after == sharded_losses
    return r


def _fsdp_all_sharded_reference(rank: int, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _LoraNet()
    fully_shard(model, mesh=mesh)
    losses = _adamw_losses(model, rank)
    return model, losses, None


def _peft_fsdp(rank: int, mesh) -> dict:
    """peft LoRA over a frozen base FSDP2 ignores, the base offloaded, with fully_shard before or
    after wrap_model, against the unwrapped FSDP2 run."""
    import peft

    import offtensor as ot
    from offtensor.tensor import OffloadedTensor
    from torch.distributed.fsdp import fully_shard

    def run(order):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False))
        frozen = {p for p in model.parameters() if not p.requires_grad}
        policy = {"offload": ["*base_layer*"], "keep": ["*lora_*"]}
        if order == "wrap_first":
            ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=policy, device="cpu")
        fully_shard(model, mesh=mesh, ignored_params=frozen)
        if order == "fsdp_first":
            ot.wrap_model(model, budget_gb=_LORA_BUDGET_GB, policy=policy, device="cpu")
        offloaded = sum(isinstance(p, OffloadedTensor) for p in model.parameters())
        losses = _adamw_losses(model, rank)
        return losses, [p.full_tensor() for p in model.parameters() if p.requires_grad], offloaded

    ref_losses, ref_adapters, _ = run(None)
    r = {}
    for order in ("wrap_first", "fsdp_first"):
        losses, adapters, offloaded = run(order)
        r[order] = (losses == ref_losses, all(map(torch.equal, adapters, ref_adapters)), offloaded)
    return r


P2P_TIMEOUT = datetime.timedelta(seconds=20)


def _point_to_point(rank: int) -> dict:
    """Exchanges in which each rank posts its send and then its receive, with plain and offloaded
    buffers, on a group whose short timeout turns a deadlock into an error within seconds."""
    import offtensor as ot

    group = dist.new_group(timeout=P2P_TIMEOUT)
    peer = 1 - rank

    def buffers(send_off: bool, recv_off: bool, n: int = 5):
        send = torch.arange(n, dtype=torch.float32) + 10.0 * rank
        recv = torch.full((n,), -1.0)
        offload = lambda t, off: ot.offload(t, device="cpu") if off else t  # noqa: E731
        return offload(send, send_off), offload(recv, recv_off)

    r = {}
    for send_off in (False, True):
        for recv_off in (False, True):
            send, recv = buffers(send_off, recv_off)
            _ = recv + 0  # a cached device copy of the receive buffer: the write-back must drop it
            sent = dist.isend(send, peer, group=group)
            received = dist.irecv(recv, peer, group=group)
            received.wait()
            sent.wait()
            r[("isend_irecv", send_off, recv_off)] = (type(recv).__name__, recv.cpu().tolist(), (recv + 0).tolist())
            send, recv = buffers(send_off, recv_off)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group=group),
                                            dist.P2POp(dist.irecv, recv, peer, group=group)])
            for work in works:
                work.wait()
            r[("batch", send_off, recv_off)] = (type(recv).__name__, recv.cpu().tolist())
    # a receive into a view of an offloaded tensor reaches its master: every alias sees it
    base = ot.offload(torch.zeros(8), device="cpu")
    view = base[2:7]
    send, _ = buffers(True, False)
    sent, received = dist.isend(send, peer, group=group), dist.irecv(view, peer, group=group)
    received.wait()
    sent.wait()
    r["view"] = base.cpu().tolist()
    # rank 0 sends two tensors and waits for neither before receiving; rank 1 receives them in order
    a, b = torch.full((3,), 1.0 + rank), torch.full((3,), 2.0 + rank)
    got = [ot.offload(torch.zeros(3), device="cpu") for _ in range(2)]
    if rank == 0:
        works = [dist.isend(ot.offload(a, device="cpu"), 1, group=group),
                 dist.isend(ot.offload(b, device="cpu"), 1, group=group)]
        works += [dist.irecv(t, 1, group=group) for t in got]
    else:
        works = [dist.irecv(t, 0, group=group) for t in got]
        works += [dist.isend(a, 0, group=group), dist.isend(b, 0, group=group)]
    for work in works:
        work.wait()
    r["two_each_way"] = [t.cpu().tolist() for t in got]
    dist.destroy_process_group(group)
    return r


def _seed(rank: int, out_dir: str) -> dict:
    """The seed at TP=2: the reference DeepSeek (MLA absorption, routed experts, tied embeddings)
    with FP8 block-scaled attention and expert weights, built per rank, wrapped with offload_gb per
    rank, loaded slice by slice through vLLM-style weight loaders, then process_weights_after_loading."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import offtensor as ot
    from offtensor.models import tp_deepseek

    config = _deepseek_config()
    path = os.path.join(out_dir, "fp8.safetensors")
    if rank == 0:
        save_file(tp_deepseek.checkpoint(config), path)
    dist.barrier()

    def build(wrap: bool):
        model = tp_deepseek.build(config, rank, WORLD)
        if wrap:
            ot.wrap_model(model, offload_gb=0.1 / 1024, device="cpu")
        read = [0]
        with safe_open(path, "pt") as f:
            tp_deepseek.load_weights(model, ((n, tp_deepseek.CountingSlice(f.get_slice(n), read)) for n in f.keys()))
        tp_deepseek.process_weights_after_loading(model)
        return model, read[0]

    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    reference, _ = build(wrap=False)
    ref_tokens = reference.generate(ids, 6)
    model, read = build(wrap=True)
    ot.reset_stats(model)
    tokens = model.generate(ids, 6)
    s = ot.stats(model)
    offloaded = _offloaded_leaves(model)
    return {"tokens_equal": torch.equal(tokens, ref_tokens), "distinct_tokens": len(set(ref_tokens[0, 6:].tolist())),
            "offloaded_bytes": s.offloaded_bytes, "peak": s.peak_device_bytes, "budget": s.budget_bytes,
            "master_bytes": sum({id(t._master): t._master.nbytes for t in offloaded.values()}.values()),
            "fp8_offloaded": any(t.dtype == torch.float8_e4m3fn for t in offloaded.values()),
            "read_bytes": read, "file_bytes": os.path.getsize(path),
            "tied": model.lm_head.weight is model.embed_tokens.weight, "absorbed": hasattr(model.layers[0].self_attn, "W_UK")}

"""Worker for tests/test_fsdp.py and tests/test_distributed.py (2 CPU processes, gloo).

``head OUT``: started by torchrun. A trained output head (with a bias) sharded over the ranks with torch's
``fully_shard``; each rank's loss and scoring log-probs through :func:`grpo_kit.trainer.sharding.full_head`, and
the gradients, against the unsharded head in the same process (its gradient: the ranks' mean, as FSDP averages).

``update OUT TOTAL_MICRO LOSS_TYPES CHECKPOINTING``: started by ``accelerate launch`` (an FSDP2 config, DDP, or
one process; tests/test_fsdp.py and tests/test_distributed.py). For each loss type (comma-separated), one optimiser
step of EfficientGRPOTrainer's loss with LoRA over a fixed list of micro-batches split round-robin across
processes; saves the trainable parameters' updates (gathered). W processes x accumulation k must give 1 process x
accumulation W*k's update. CHECKPOINTING: ``hf`` (the model's own, as a DDP run has it) or ``none`` (FSDP2
checkpoints the layers itself). The loss types share one launch: starting the processes is most of the time.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps  # noqa: E402
from grpo_kit.trainer.sharding import full_head  # noqa: E402


def length_reward(prompts, completions, **kwargs):
    """A reward with spread on a random model (its completions differ in length): the train-run check's."""
    return [float(len(str(c))) / 10.0 for c in completions]


class _Head(torch.nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=True)

    def get_output_embeddings(self):
        return self.lm_head


def _head_loss(weight, bias, hidden, ids, mask, adv, ref):
    loss, _ = efficient_grpo_loss(
        hidden,
        weight,
        ids,
        mask,
        adv,
        ref_logps=ref,
        beta=0.04,
        loss_type="dapo",
        num_items_in_batch=mask.sum(),
        chunk_size=4,
        lm_head_bias=bias,
    )
    return loss


def head_main(out_path):
    from torch.distributed.fsdp import fully_shard  # lazy: only this mode shards by hand

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Head(16, 50)  # 50 vocabulary rows: 25 per rank
    full_w = model.lm_head.weight.detach().clone().requires_grad_(True)
    full_b = model.lm_head.bias.detach().clone().requires_grad_(True)
    fully_shard(model.lm_head)
    fully_shard(model)
    inputs = []
    for r in range(world):  # every rank's batch, so each rank can form the unsharded mean
        g = torch.Generator().manual_seed(10 + r)
        B, T = 2, 5
        inputs.append(
            dict(
                hidden=torch.randn(B, T, 16, generator=g),
                ids=torch.randint(0, 50, (B, T), generator=g),
                mask=(torch.rand(B, T, generator=g) > 0.2).float(),
                adv=torch.randn(B, generator=g),
                ref=-torch.rand(B, T, generator=g) * 4,
            )
        )
    mine = {k: v.clone() for k, v in inputs[rank].items()}
    mine["hidden"].requires_grad_(True)
    weight, bias = full_head(model)
    sharded = isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    with torch.no_grad():
        logps = per_token_logps(mine["hidden"], weight, mine["ids"], chunk_size=4, lm_head_bias=bias)
    loss = _head_loss(weight, bias, **mine)
    loss.backward()
    ref_losses, ref_gw, ref_gb, ref_gh = [], [], [], None
    for r in range(world):
        x = {k: v.clone() for k, v in inputs[r].items()}
        x["hidden"].requires_grad_(True)
        full_w.grad = full_b.grad = None
        lr = _head_loss(full_w, full_b, **x)
        lr.backward()
        ref_losses.append(lr.detach())
        ref_gw.append(full_w.grad.clone())
        ref_gb.append(full_b.grad.clone())
        if r == rank:
            ref_gh = x["hidden"].grad.clone()
            with torch.no_grad():
                ref_logps = per_token_logps(x["hidden"], full_w, x["ids"], chunk_size=4, lm_head_bias=full_b)
    result = dict(
        sharded=sharded,
        local_rows=model.lm_head.weight.to_local().shape[0],
        loss=loss.detach(),
        ref_loss=ref_losses[rank],
        logps=logps,
        ref_logps=ref_logps,
        grad_hidden=mine["hidden"].grad,
        ref_grad_hidden=ref_gh,
        grad_weight=model.lm_head.weight.grad.full_tensor(),
        ref_grad_weight=sum(ref_gw) / world,
        grad_bias=model.lm_head.bias.grad.full_tensor(),
        ref_grad_bias=sum(ref_gb) / world,
    )
    torch.save(result, f"{out_path}.rank{rank}")
    dist.destroy_process_group()


def update_main(out_path: str, total_micro: int, loss_types: list[str], checkpointing: str):
    updates, facts = {}, {}
    for loss_type in loss_types:
        facts, updates[loss_type] = _one_update(out_path, total_micro, loss_type, checkpointing == "hf")
    if facts.pop("main"):
        torch.save({**facts, "updates": updates}, out_path)


def _one_update(out_path: str, total_micro: int, loss_type: str, hf_checkpointing: bool):
    from peft import LoraConfig  # lazy: this mode only
    from trl import GRPOConfig  # lazy: this mode only

    from grpo_kit.model.loading import load_model  # lazy: this mode only
    from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset  # lazy: this mode only
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer  # lazy: this mode only

    torch.manual_seed(0)
    model, tok = load_model("tiny-llama")
    tok.padding_side = "left"
    probe = GRPOConfig(output_dir="/tmp/update-probe", use_cpu=True, report_to="none")
    world = probe.world_size
    gas = total_micro // world
    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "out"),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_accumulation_steps=gas,
        max_completion_length=6,
        beta=0.04,
        loss_type=loss_type,
        use_bias_correction_kl=False,
        save_strategy="no",
        gradient_checkpointing=hf_checkpointing,
    )
    trainer = EfficientGRPOTrainer(
        model=model,
        reward_funcs=[lambda prompts, completions, **k: [0.0] * len(prompts)],
        args=args,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 4)),
        processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    acc = trainer.accelerator
    gen = torch.Generator().manual_seed(1)
    for p in trainer.model.parameters():  # same non-zero LoRA weights in every process
        if p.requires_grad:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    before = {_name(n): p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    wrapped = acc.prepare(trainer.model)
    opt = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=1.0)
    _run_window(trainer, acc, wrapped, gen, total_micro, world, gas)
    opt.step()
    update = {_name(n): _whole(p) - before[_name(n)] for n, p in trainer.model.named_parameters() if p.requires_grad}
    facts = {
        "world": world,
        "gas": gas,
        "distributed_type": str(acc.distributed_type),
        "main": acc.is_main_process,
        "sharded": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
    }
    return facts, update


def _name(n):
    return n.replace("_checkpoint_wrapped_module.", "")  # FSDP's activation-checkpointing wrapper


def _whole(p):
    return p.detach().full_tensor() if type(p).__name__ == "DTensor" else p.detach()


def _run_window(trainer, acc, wrapped, gen, total_micro, world, gas):
    B, P, C = 2, 5, 6
    batches = []
    lengths = torch.randint(1, C + 1, (total_micro, B), generator=gen)
    for i in range(total_micro):
        batches.append(
            dict(
                prompt_ids=torch.randint(3, 1000, (B, P), generator=gen),
                prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.randint(3, 1000, (B, C), generator=gen),
                completion_mask=(torch.arange(C)[None] < lengths[i][:, None]).long(),
                advantages=torch.randn(B, generator=gen),
            )
        )
    total_tokens = float(sum(b["completion_mask"].sum() for b in batches))
    trainer.current_gradient_accumulation_steps = gas
    trainer.args.steps_per_generation = gas
    trainer.model.train()
    for inputs in batches[acc.process_index :: world]:
        inputs["num_items_in_batch"] = torch.tensor(total_tokens)  # the whole window's active tokens, all ranks
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad(), trainer.model.disable_adapter():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, C)[0]
        with acc.accumulate(wrapped):
            loss = trainer._compute_loss(wrapped, inputs)
            acc.backward(loss)


if __name__ == "__main__":
    from _cli_worker import exit_now  # the teardown abort (tests/_cli_worker.py)

    if sys.argv[1] == "head":
        head_main(sys.argv[2])
    else:
        update_main(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5])
    exit_now(0)

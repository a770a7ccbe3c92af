"""Worker for tests/test_distributed.py, started by `accelerate launch`.

Runs one optimiser step of EfficientGRPOTrainer's loss over a fixed list of micro-batches,
split round-robin across processes, and saves the trainable parameters' update. With DDP,
W processes x accumulation k must give the same update as 1 process x accumulation W*k.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset  # noqa: E402
from grpo_kit.model.loading import load_model  # noqa: E402
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer  # noqa: E402


def main(out_path: str, total_micro: int, loss_type: str):
    torch.manual_seed(0)
    model, tok = load_model("tiny-llama")
    tok.padding_side = "left"
    probe = GRPOConfig(output_dir="/tmp/ddp-probe", use_cpu=True, report_to="none")
    world = probe.world_size
    gas = total_micro // world
    args = GRPOConfig(output_dir=str(Path(out_path).parent / "out"), use_cpu=True, report_to="none", bf16=False,
                      per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=gas,
                      max_completion_length=6, beta=0.04, loss_type=loss_type, use_bias_correction_kl=False,
                      save_strategy="no")
    trainer = EfficientGRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **k: [0.0] * len(prompts)],
                                   args=args, train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 4)),
                                   processing_class=tok,
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          task_type="CAUSAL_LM"))
    acc = trainer.accelerator
    gen = torch.Generator().manual_seed(1)
    for p in trainer.model.parameters():  # same non-zero LoRA weights in every process
        if p.requires_grad:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    ddp_model = acc.prepare(trainer.model)
    opt = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=1.0)

    B, P, C = 2, 5, 6
    batches = []
    lengths = torch.randint(1, C + 1, (total_micro, B), generator=gen)
    for i in range(total_micro):
        batches.append(dict(
            prompt_ids=torch.randint(3, 1000, (B, P), generator=gen), prompt_mask=torch.ones(B, P, dtype=torch.long),
            completion_ids=torch.randint(3, 1000, (B, C), generator=gen),
            completion_mask=(torch.arange(C)[None] < lengths[i][:, None]).long(),
            advantages=torch.randn(B, generator=gen)))
    total_tokens = float(sum(b["completion_mask"].sum() for b in batches))
    trainer.current_gradient_accumulation_steps = gas
    trainer.args.steps_per_generation = gas
    trainer.model.train()
    mine = batches[acc.process_index::world]
    for inputs in mine:
        inputs["num_items_in_batch"] = torch.tensor(total_tokens)  # the whole window's active tokens, all ranks
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad(), trainer.model.disable_adapter():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, C)[0]
        with acc.accumulate(ddp_model):
            loss = trainer._compute_loss(ddp_model, inputs)
            acc.backward(loss)
    opt.step()
    if acc.is_main_process:
        update = {n: (p.detach() - before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad}
        torch.save({"world": world, "gas": gas, "update": update}, out_path)


if __name__ == "__main__":
    from _cli_worker import exit_now  # the teardown abort (tests/_cli_worker.py)

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    exit_now(0)

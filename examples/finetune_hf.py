"""Fine-tune a pretrained Hugging Face causal LM with tensor parallelism: checkpoint in, a few
steps, checkpoint out.

    torchrun --nproc-per-node 2 examples/finetune_hf.py --model <directory or Hub id in the
        cache> --out finetuned [--steps 20] [--lr 1e-5] [--dtype bfloat16] [--lora]
        [--text FILE] [--seq 256] [--batch 4]

- the model comes from ``tpx.from_pretrained``: built on the meta device, sharded over every
  rank, each rank reading only its part of the safetensors files;
- ``--lora``: peft's LoRA adapters on the attention projections, sharded with them; only the
  adapters train;
- the data: ``--text FILE`` tokenized with the checkpoint's tokenizer, else random token ids
  (a checkpoint without a tokenizer, as the one ``--make-tiny`` writes);
- the way out: ``model.save_pretrained(out)`` on every rank, each rank writing its part of
  the files: the full model, or with ``--lora`` peft's adapter files.

``--make-tiny DIR`` first writes a tiny random Llama there (nothing downloaded), for a try on
a laptop: ``torchrun --nproc-per-node 2 examples/finetune_hf.py --make-tiny tiny --model tiny
--out tiny-ft``. Rank 0 shows a progress bar; at the end the directory is read back on one
process and its logits are compared with the trained sharded model's.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import tpx


def batches(args, vocab: int, tokenizer):
    """``--batch`` x ``--seq`` token ids per step, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    if args.text and tokenizer is not None:
        with open(args.text, encoding="utf-8") as f:
            ids = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long)
        n = args.seq * args.batch
        while True:
            start = int(torch.randint(0, max(1, len(ids) - n), (1,), generator=g))
            yield ids[start:start + n].reshape(args.batch, args.seq)
    while True:
        yield torch.randint(0, vocab, (args.batch, args.seq), generator=g)


def make_tiny(path: str) -> None:
    import transformers

    if dist.get_rank() == 0 and not os.path.exists(path):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2)).save_pretrained(path)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--text", default=None)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--make-tiny", default=None, metavar="DIR")
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    if args.make_tiny:
        make_tiny(args.make_tiny)

    model = tpx.from_pretrained(args.model, dtype=args.dtype)   # each rank: its shards only
    tokenizer = None
    try:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    except Exception:  # noqa: BLE001 - no tokenizer: random ids
        pass
    if args.lora:
        import peft

        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, config)  # wraps tpx's layers as it is
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    data = batches(args, model.config.vocab_size, tokenizer)
    device = next(model.parameters()).device
    steps = range(args.steps)
    if rank == 0:
        from tqdm import tqdm

        steps = tqdm(steps, desc="fine-tuning")
    for _ in steps:
        ids = next(data).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            steps.set_postfix(loss=f"{loss.item():.4f}")

    model.save_pretrained(args.out)  # every rank writes its part (with --lora: the adapters)

    # The directory, read back on one process, gives the trained model's logits.
    model.eval()
    ids = next(data)[:1, :16].to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank == 0:
        import transformers

        if args.lora:
            import peft

            back = peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=logits.dtype),
                args.out)
        else:
            back = transformers.AutoModelForCausalLM.from_pretrained(args.out,
                                                                     dtype=logits.dtype)
        with torch.no_grad():
            ref = back.to(device)(input_ids=ids).logits
        diff = float((ref - logits).abs().max())
        tol = 1e-4 if logits.dtype == torch.float32 else 5e-2
        print(f"wrote {args.out}; read back on one process: largest logit difference {diff:.2e}")
        assert diff <= tol * max(1.0, float(ref.abs().max())), diff
    tpx.end_run()


if __name__ == "__main__":
    main()

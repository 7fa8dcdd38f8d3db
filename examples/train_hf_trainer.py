"""Hugging Face's Trainer with memfit: one callback plans the Trainer's own step (its optimizer,
gradient accumulation, bf16/fp16 autocast and clipping) on the first batch and applies the plan.

    python examples/train_hf_trainer.py --budget 6MB --steps 3                 # a small GPT-2, on the CPU
    python examples/train_hf_trainer.py --budget auto --layers 24 --width 1024   # on a GPU: what it can hold

The first run profiles (a few seconds here) and caches the plan under ~/.cache/memfit; later runs
of the same model, batch shape and settings load it. Needs transformers and accelerate.
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers

import memfit
import memfit.hf


class RandomTokens(torch.utils.data.Dataset):
    """Stand-in for a tokenized dataset: rows of random token ids, labels the same ids."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="6MB", help="memory budget, e.g. 20GB, or auto on a GPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the Trainer's bf16=True)")
    args = parser.parse_args()

    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 32),
                                     vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir="hf-trainer-out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=1e-3, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        logging_steps=1, report_to=[], save_strategy="no")
    trainer = transformers.Trainer(model=model, args=training, train_dataset=RandomTokens(64, 32, 256),
                                   callbacks=[memfit.hf.MemfitCallback(budget=args.budget)])
    try:
        trainer.train()
    except memfit.MemfitError as exc:  # a budget below what the model needs says the smallest that works
        parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # the application decides what is shown:
    logging.getLogger("memfit").setLevel(logging.INFO)  # memfit's one-line reports
    main()

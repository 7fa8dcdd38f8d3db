"""Lightning with memfit: one callback plans the Trainer's own step (its optimizer,
accumulate_grad_batches, precision and gradient clipping) on the first batch, running the
module's training_step, and applies the plan.

    python examples/train_lightning.py --budget 5MB --steps 3                 # a small GPT, on the CPU
    python examples/train_lightning.py --budget auto --precision bf16-mixed    # on a GPU: what it can hold

The first run profiles and caches the plan under ~/.cache/memfit; later runs load it. Needs lightning.
"""

from __future__ import annotations

import argparse
import logging

import lightning.pytorch as L
import torch
from torch.nn import functional as F

import memfit
from memfit.integrations.lightning import MemfitCallback
from memfit.zoo import gpt


class LanguageModel(L.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=layers)[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)["logits"]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="5MB", help="memory budget, e.g. 20GB, or auto on a GPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precision", default="32-true", help="Lightning's precision: 32-true, bf16-mixed, ...")
    args = parser.parse_args()

    tokens = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens.roll(-1, 1)), batch_size=4)
    trainer = L.Trainer(max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
                        precision=args.precision, logger=False, enable_checkpointing=False,
                        callbacks=[MemfitCallback(budget=args.budget)])
    try:
        trainer.fit(LanguageModel(args.layers), loader)
    except memfit.MemfitError as exc:  # a budget below what the model needs says the smallest that works
        parser.exit(2, f"{exc}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # the application decides what is shown:
    logging.getLogger("memfit").setLevel(logging.INFO)  # memfit's one-line reports
    main()

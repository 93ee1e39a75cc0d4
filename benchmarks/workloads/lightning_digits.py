"""A PyTorch Lightning classifier of scikit-learn's digits, in the shape of
Lightning's image-classifier examples: a LightningDataModule, a
LightningModule that logs with self.log and gathers its step losses for
on_train_epoch_end, an LR scheduler, and a default Trainer with
EarlyStopping and ModelCheckpoint (its logger's files under
lightning_logs/)."""
import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset, random_split


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size, repeat):
        super().__init__()
        self.batch_size, self.repeat = batch_size, repeat

    def setup(self, stage):
        x, y = load_digits(return_X_y=True)
        data = TensorDataset(torch.tensor(x, dtype=torch.float32).div(16.0), torch.tensor(y))
        n_val = len(data) // 6
        train, self.val = random_split(data, [len(data) - n_val, n_val],
                                       generator=torch.Generator().manual_seed(0))
        self.train = ConcatDataset([train] * self.repeat)  # a larger epoch, for timing

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=256)


class Classifier(L.LightningModule):
    def __init__(self, width=128, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
        self.step_losses = []
        self.validations = 0  # validation epochs run, the sanity check's included

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.step_losses.append(loss.detach())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def on_validation_epoch_end(self):
        self.validations += 1

    def on_train_epoch_end(self):
        mean = torch.stack(self.step_losses).mean()
        self.step_losses.clear()
        metrics = self.trainer.callback_metrics
        print(f"epoch {self.current_epoch} step {self.global_step} train_loss {mean:.4f} "
              f"val_loss {metrics['val_loss']:.4f} val_acc {metrics['val_acc']:.4f} "
              f"validations {self.validations}")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return [optimizer], [scheduler]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=-1, help="ends the fit instead")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1, help="copies of the dataset")
    parser.add_argument("--patience", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)

    model = Classifier(width=args.width)
    trainer = L.Trainer(
        max_epochs=args.epochs, max_steps=args.max_steps, enable_progress_bar=False,
        deterministic=True,
        callbacks=[EarlyStopping("val_loss", patience=args.patience),
                   ModelCheckpoint(monitor="val_acc", mode="max")])
    trainer.fit(model, datamodule=DigitsData(args.batch_size, args.repeat))
    print(f"best val_acc {trainer.checkpoint_callback.best_model_score:.4f}")


if __name__ == "__main__":
    main()

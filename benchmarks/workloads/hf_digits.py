"""A Hugging Face Trainer script in the shape of transformers' text
classification examples: a small BERT built from a config (nothing
downloaded) classifies scikit-learn's digits, each 8x8 image a sequence of
64 pixel tokens.  A Trainer subclass with its own compute_loss (label
smoothing), gradient accumulation, a cosine schedule with warmup, logging
every few steps, an evaluation and a saved checkpoint per epoch, the best
model loaded at the end, and a callback of the script's own that keeps the
logged losses.  A plain training script (it does not import flor).

    python hf_digits.py --epochs 4
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)


class Digits(torch.utils.data.Dataset):
    def __init__(self, images, labels, repeat=1):
        cls = np.full((len(images), 1), 17)  # a [CLS] token after the 17 pixel values
        self.ids = torch.tensor(np.concatenate([cls, images], 1)).repeat(repeat, 1)
        self.labels = torch.tensor(labels).repeat(repeat)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class SmoothedTrainer(Trainer):
    def __init__(self, *args, smoothing=0.1, **kwargs):
        super().__init__(*args, **kwargs)
        self.smoothing = smoothing

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels, label_smoothing=self.smoothing)
        return (loss, outputs) if return_outputs else loss


class LossHistory(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append(round(float(logs["loss"]), 4))

    def on_epoch_end(self, args, state, control, **kwargs):
        print(f"epoch {state.epoch:.0f}: {len(self.losses)} losses logged")


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="copies of the training set per epoch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--output-dir", default="hf-digits")
    a = p.parse_args()
    set_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    images = digits.data.astype(np.int64)
    train = Digits(images[:1400], digits.target[:1400], a.repeat)
    test = Digits(images[1400:], digits.target[1400:])
    config = BertConfig(vocab_size=18, hidden_size=a.hidden, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=2 * a.hidden,
                        max_position_embeddings=65, num_labels=10)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=a.output_dir, num_train_epochs=a.epochs,
                             per_device_train_batch_size=32, gradient_accumulation_steps=a.accum,
                             learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=5,
                             logging_steps=10, eval_strategy="epoch", save_strategy="epoch",
                             save_total_limit=2, load_best_model_at_end=True,
                             metric_for_best_model="accuracy", report_to="none",
                             disable_tqdm=True, seed=0, use_cpu=True)
    history = LossHistory()
    trainer = SmoothedTrainer(model=model, args=args, train_dataset=train, eval_dataset=test,
                              compute_metrics=compute_metrics, callbacks=[history])
    trainer.train()
    print("logged losses:", history.losses)
    print("best checkpoint:", trainer.state.best_model_checkpoint)
    metrics = trainer.evaluate()
    print(f"test accuracy {metrics['eval_accuracy']:.4f}")


if __name__ == "__main__":
    main()

"""A callback that crashes a run at a given step, as a killed process would stop it."""

import lightning as L


class CrashAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")

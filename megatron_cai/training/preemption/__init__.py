"""Exit signals (SIGTERM, SIGINT, SIGUSR1): recorded from the first line of ``pretrain_gpt.py``
(``exit_signal``), and a torchrun that survives Slurm's SIGUSR1 and hands it to its workers (``torchrun``).
Nothing here imports torch at import time: it runs before torch is loaded."""

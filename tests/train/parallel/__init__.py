"""Real multi-rank torchrun jobs (train/parallel/): DDP, FSDP2, PowerSGD, another job size."""

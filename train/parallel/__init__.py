"""How ranks cooperate: process groups, seeding, DDP and its comm hooks (PowerSGD), FSDP2; imports config and optim."""

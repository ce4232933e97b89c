"""Where and how programs run: device meshes and sharding rules (sharding.py), multi-process start-up
(distributed.py) and XLA CPU option sets (xla_cpu.py)."""

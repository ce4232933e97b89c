"""Where and how programs run: device meshes and sharding rules (sharding.py), multi-process start-up
(distributed.py), XLA CPU option sets (xla_cpu.py) and a quiet backend probe at start-up (backend_probe.py)."""

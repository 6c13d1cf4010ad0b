"""The planner: parameter summary, per-device memory model, fit search, report, ahead-of-time compilation
(CPU meshes and TPU topologies) and hardware figures."""

"""Everything that reads or writes model artifacts: training checkpoints, exports, loading."""

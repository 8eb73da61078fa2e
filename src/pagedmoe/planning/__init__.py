"""Pure-Python planning: model shape, cost model, placement, the planner and the KV sizing (no torch.cuda)."""

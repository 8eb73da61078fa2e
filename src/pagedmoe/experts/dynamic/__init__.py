"""Dynamic expert precision: the ladder and policy, the pressure controller, the layer versions."""

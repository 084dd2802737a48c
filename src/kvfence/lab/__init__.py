"""The incident lab: fault profiles that re-create published isolation bugs, the replay and the defence matrix."""

"""rtrl: real-time RL for an AI coding assistant."""

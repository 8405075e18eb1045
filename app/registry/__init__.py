"""What ops and the trainer change, with no web framework in it: checkpoints, experiments,
routing and its notification, control flags, and the audit log of every change."""

"""Pure reward signals shared by the gateway and the workers: follow-up classification, and
reward components with the formulas that turn them into a reward."""

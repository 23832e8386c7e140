"""One module per Kubernetes controller the simulator reproduces; each exports a ``reconcile`` pass."""

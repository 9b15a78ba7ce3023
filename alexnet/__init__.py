"""AlexNet training core: models, config, optimizer, training loop, checkpoints, metrics, parallel machinery."""

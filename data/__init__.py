"""Data: ImageNet layouts, batch files, reader, device-side augmentation, loader, synthetic data."""

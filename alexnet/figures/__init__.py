"""The paper's figures from any weights (Krizhevsky et al. 2012, Fig. 3 and 4), and a run's report page.

- ``filters``: conv1's kernels, in the model's columns (``filters.png``);
- ``predictions``: validation images with their top-5 classes (``predictions.png``);
- ``neighbours``: validation images and their nearest training images by fc7 features (``neighbours.png``);
- ``make``: the three for one set of weights (``scripts/figures.py``);
- ``curves`` and ``report``: a run directory's learning curves and its page (``scripts/report.py``).
"""

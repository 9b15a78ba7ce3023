"""Every weight format this repository reads or writes, one module each, and how each maps onto our layers.

=============  ================================================  ====================  ====================
format         what it is                                        module                read / written by
=============  ================================================  ====================  ====================
checkpoint     our training checkpoint (kind                     checkpoint_file       load_weights, train.py
               ``alexnet-checkpoint``): config, weights,                               / Trainer, convert
               velocities, LR-policy state, position
weights        kind ``alexnet-weights``: config and weights      checkpoint_file       load_weights
               only (a Theano epoch converted without                                  / convert
               momentum); train.py starts from it (epoch 0)
torchvision    torchvision's AlexNet state dict = our ``owt``    torchvision           load_weights
               (same keys)
state_dict     a plain state dict of our ``alexnet``/            state_dict            load_weights (--arch)
               ``caffenet`` (same keys, another layer order,
               so the arch must be named)
theano         Ding et al.'s folder of per-layer ``.npy``        theano (files),       read_theano,
               files, one set per epoch                          theano_layout         load_weights
                                                                 (arrays)              / write_theano
caffe          BVLC's ``.caffemodel`` (protobuf NetParameter,    caffe (mapping),      load_weights,
               V1 or V2): bvlc_alexnet = our ``alexnet``,        caffe_proto (file)    convert
               bvlc_reference_caffenet = ``caffenet``, with
               Caffe's LRN (``model.lrn: caffe``)
=============  ================================================  ====================  ====================

``alexnet_bn`` (batch norm) lives in our checkpoints, weights files and plain state dicts (``--arch
alexnet_bn``) only: the Theano files, BVLC's nets and torchvision's hold no batch-norm statistics, so
the Theano export, a ``.caffemodel`` with a BatchNorm layer and ``--arch alexnet_bn`` on the others are
refused in one line.

Beside them: ``common`` (FormatError, safe .npy reading, strict loading, width and crop inference:
what every format uses), ``mean_image`` (mean image files for evaluation: .npy, Caffe's .binaryproto),
``convert`` (Theano epochs <-> our files, Caffe models -> our checkpoints, for scripts/convert_weights.py),
``start`` (what ``run.resume_from`` names: a checkpoint, or any weights above by path or name as a run's start),
``geometry`` (the preprocessing each weight set was measured with, for evaluate's notice and predict.py)
and ``load`` (detect + load_weights, for evaluation).
Imports point one way: common <- the formats <- convert, load <- start; nothing here imports the trainer.

Every ``.npy`` is read with ``allow_pickle=False``; every ``.pt`` with ``torch.load(weights_only=True)``.
"""

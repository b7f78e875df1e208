"""The optimisers, one module each (a family of them where one extends another): each is a class
that holds its hyper-parameters and builds its update, registered by name
(:func:`~.base.register_optimizer`). Importing this package registers the built-in ones, in the
order the command line lists them; another optimiser is a module of its own that registers its
class, imported before artifacts are built or loaded."""

from onnx_autodiff.training.update_rules import sgd, adam  # noqa: F401  (registers them, in this order)

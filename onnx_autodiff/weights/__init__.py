"""Which tensors of a model file are its weights, and in what form they are stored: the module
parameters of an exported file recovered under their own names (:mod:`.recovery`), and weights
stored quantized or in half precision, read, written back and stored so (:mod:`.quantized`).
``grad``, ``params`` and training read them alike."""

"""Protobuf entry points: the gradient of a list of nodes or of a function as an onnx.FunctionProto."""
def gradient_of_nodes(*a, **k):
    raise NotImplementedError


def gradient_of_function(*a, **k):
    raise NotImplementedError

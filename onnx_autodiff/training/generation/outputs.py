"""The graph outputs of a model being built, each a value of its own under a name of its own, and
the state each one carries to the next step."""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.manifest import Carried


class Outputs:
    """Outputs published in order (:attr:`values`); ``op`` emits the Identity nodes that publishing
    needs (and the steps that compute the outputs emit theirs with it; :meth:`add_nodes_to` adds
    them to the graph), ``namer`` names them."""

    def __init__(self, op: OpBuilder, namer: Namer) -> None:
        self.op = op
        self.namer = namer
        self.values: list[ir.Value] = []
        self.carry: list[Carried] = []  # (key, input, output) of each output that replaces an input
        self._taken: set[ir.Value] = set()
        self._added = 0  # how many of op's nodes a graph holds

    def add_nodes_to(self, graph: ir.Graph) -> None:
        """Appends to ``graph`` the nodes ``op`` emitted since the last call, in order. (One builder
        emits a model's outputs, whichever step computes them: the nodes' names count its nodes.)"""
        graph.extend(self.op.nodes[self._added:])
        self._added = len(self.op.nodes)

    def publish(self, value: ir.Value, hint: str, like: ir.Value | None = None) -> ir.Value:
        """``value`` as an output named after ``hint`` and typed like ``like`` (an Identity where it
        cannot be renamed: no node's output, an input, another output)."""
        if value.producer() is None or value in self._taken or value.is_graph_output() or value.is_graph_input():
            value = self.op.Identity(value)
        self._taken.add(value)
        value.name = None
        value.name = self.namer.fresh(hint)
        if like is not None:
            value.type, value.shape = like.type, like.shape
        self.values.append(value)
        return value

    def add_loss(self, loss: ir.Value) -> ir.Value:
        """The loss as the first output, under its name unless it is a graph input."""
        if loss.is_graph_input():
            return self.publish(loss, "loss")
        self._taken.add(loss)
        self.values.append(loss)
        return loss

    def add_carried(self, old: ir.Value, new: ir.Value) -> ir.Value:
        """``new`` as the output that replaces the input ``old`` at the next step."""
        out = self.publish(new, f"{old.name}.new", like=old)
        self.carry.append(Carried(old.name, old.name, out.name))
        return out

    def add_as_is(self, value: ir.Value) -> ir.Value:
        """``value`` under its own name, through an Identity of a fresh name where it is a graph
        input or already an output (a model output beside the loss)."""
        if value.is_graph_input() or value in self._taken:
            name = value.name
            value = self.op.Identity(value)
            value.name = self.namer.fresh(name)
        self._taken.add(value)
        self.values.append(value)
        return value

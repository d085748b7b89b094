"""Module forwards: the stack of running calls, and the bytes each saves for backward.

Forward pre/post hooks sample the backend around each module call and fold the figures into
the module's :class:`~memsentry.record.layers.LayerRecord`; the saved-tensor hook around each
outermost call (:mod:`memsentry.record.saved`) attributes what is saved for backward to the
module running. Calls of other threads than the loop's, and calls inside a backward pass
(checkpointing's recomputation), are not measured.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memsentry.measure import StorageBackend
from memsentry.model import Location
from memsentry.record.backward import BackwardTimer, tensors_in
from memsentry.record.calls import ForwardCall, in_backward, stale_calls
from memsentry.record.coverage import Coverage
from memsentry.record.entry import entered_through
from memsentry.record.failure import FailureWatch
from memsentry.record.hooks import ModuleHooks
from memsentry.record.invisible import install as install_invisibility
from memsentry.record.invisible import uninstall as remove_invisibility
from memsentry.record.layers import (
    LayerRecord,
    LayerRegistry,
    compiled_original,
    storage_bytes,
)
from memsentry.record.outermost import OutermostCalls
from memsentry.record.parts import Parts
from memsentry.record.sampler import Sampler
from memsentry.record.saved import SavedTensors, top_hooks
from memsentry.record.threads import Owner
from memsentry.record.timeline import IterationClock
from memsentry.record.versions import learn as learn_wording
from memsentry.usercode.frames import is_user_class, source_file, spelled_name, user_frames
from memsentry.usercode.savedhooks import registers_saved_hooks

#: Checked (torch 2.13, gloo, 2 ranks): ``unshard()`` then ``reshard()`` of a unit whose
#: unsharded parameters take 257 KiB moved glibc's count by 257 KiB, the mode's by nothing;
#: in tracked steps, the mode's peak of the unit's forward lacked those 257 KiB, and its count
#: after the steps still held storages FSDP2 had resized to 0.
SHARDED_NOTE = (
    "are FSDP2 units (fully_shard): FSDP2 allocates and frees their unsharded parameters by "
    "resizing storages in place, which no op shows to the dispatch mode that counts CPU "
    "storages here; the mode counts such a storage at the size it had when made (not at all "
    "when made before tracking) for as long as it exists, so the CPU figures can be off by "
    "up to the unsharded parameters' bytes, either way (glibc's counters, the default "
    "without exact=True where glibc has mallinfo2(), see them)."
)


def user_files(model: nn.Module | None, frame: types.FrameType | None) -> list[str | None]:
    """The files of the user's code known at the start: those defining the model's own
    classes, the main script and those on the stack."""
    files = [] if model is None else [
        source_file(type(m)) for m in model.modules() if is_user_class(type(m))]
    files.append(getattr(sys.modules.get("__main__"), "__file__", None))
    return files + [f.f_code.co_filename for f in user_frames(frame)]


def _fold_into(parent: ForwardCall, call: ForwardCall) -> None:
    """A call ended inside ``parent``: its peak and what it saved are the parent's too."""
    if call.peak > parent.peak:
        parent.peak = call.peak
    for key, size in call.saved.items():
        if key not in parent.saved:
            parent.saved[key] = size
            parent.saved_bytes += size


def aside_notes(sharded: set[str], scripted: set[str], compiled: set[str],
                other_threads: int) -> list[str]:
    """What the report says of FSDP2 units when CPU storages are counted (which misses
    FSDP2's resizes), of TorchScript and torch.compile'd calls (measured as a whole), and of
    calls from threads other than the loop's."""
    aside = (
        (sharded, SHARDED_NOTE),
        (scripted, "ran as TorchScript: memsentry measured each call as a whole (memory at its "
         "boundaries, iterations, holders); the modules inside it take no hooks and are not "
         "measured one by one."),
        (compiled, "ran as torch.compile'd code: memsentry measured each call as a whole "
         "(memory at its boundaries, what it saved for backward, iterations, holders) but "
         "steps aside inside it, so the layers inside it are not measured one by one (run it "
         "uncompiled to see them)."),
    )
    notes = [f"{', '.join(f'`{n}`' for n in sorted(names))} {text}"
             for names, text in aside if names]
    if other_threads:
        notes.append(f"{other_threads:,} module calls of the tracked model came from threads "
                     "other than the loop's and were not measured (each thread's loop can have "
                     "its own tracker).")
    return notes


class ForwardRecorder:
    """The forward hooks and the saved-tensor pack hook of one recorder.

    ``start_backend(module, args)`` is called at the first module call when no backend was
    started yet (the device is then chosen from that call); ``iteration_start(module)`` before
    every outermost call (it may close an iteration, or take a pending census). ``saved``
    says whether bytes saved for backward are attributed; ``backward`` whether each layer's
    backward is timed.
    """

    def __init__(self, *, registry: LayerRegistry, sampler: Sampler, clock: IterationClock,
                 stack: list[ForwardCall], backward: BackwardTimer | None,
                 outermost: OutermostCalls, saved: bool, coverage: Coverage, parts: Parts,
                 start_backend: Callable[[nn.Module, Any], None],
                 iteration_start: Callable[[nn.Module], None], owner: Owner) -> None:
        self.active = False
        self._owner = owner
        self.other_threads = 0  # calls of the model from threads other than the loop's
        self._parts = parts
        self.failures = FailureWatch()
        self.coverage = coverage
        self.stack = stack
        self._registry = registry
        self._sampler = sampler
        self._clock = clock
        self._backward = backward
        self._outermost = outermost
        self._saved = saved
        self._start_backend = start_backend
        self._iteration_start = iteration_start
        self.compiled: set[str] = set()  # layers that ran as torch.compile'd graphs
        # The saved-tensor hooks are pushed around each outermost call only, so that code
        # between calls (a torch.func transform) never finds them on the stack; inside a
        # region that disables them, the call is measured without them.
        self.saved = SavedTensors(sampler=sampler, stack=stack, parts=parts, registry=registry,
                                  coverage=coverage)
        self.hooks = ModuleHooks(coverage, registry, self.pre_forward, self.post_forward,
                                 self.scripted_pre, self.scripted_post)
        self.script_names: set[str] = set()
        # Set when the census that kept a light iteration's hooks on was taken at its first
        # call: the hooks go bare as that call ends (a boundary clears it).
        self.unhook_after = False
        # Set at a light closing that passes the next boundaries with a count, in a loop whose
        # iterations end at the lean module's next call: as that call ends, a counter takes
        # the place of its hooks for that many calls (memsentry.record.counted).
        self.pass_after = 0
        self.on_passed: Callable[[int], None] = lambda calls: None
        self._invisible = False  # whether memsentry.record.invisible is held on for this one

    def put_on(self, model: nn.Module | None, frame: types.FrameType | None) -> None:
        """Hook ``model`` (without one, every module call of the process); ``frame``: the
        code that started tracking. Copies and scripts of the model leave the hooks out
        (:mod:`memsentry.record.invisible`), and where the user's code sets hooks on single
        saved tensors, memsentry's saved-tensor hooks stay off."""
        install_invisibility()
        self._invisible = True
        learn_wording(top_hooks(False) is not None)
        where = registers_saved_hooks(user_files(model, frame))
        if where is not None:
            self.leave_saved_to(where)
        if model is not None:
            self.hooks.hook_model(model)
        else:
            self.hooks.hook_global()

    def take_off(self) -> None:
        """Remove every hook this recorder put on."""
        self.hooks.remove_all()
        if self._invisible:
            self._invisible = False
            remove_invisibility()

    def leave_saved_to(self, where: Location) -> None:
        """The user's code at ``where`` sets hooks on single saved tensors, which torch allows
        once per tensor: memsentry puts no saved-tensor hooks on (the report says so)."""
        self._saved = False
        self.saved.user_hooks = where

    def scripted_pre(self, module: nn.Module, args: Any) -> None:
        if module in self.hooks.scripted and not torch.compiler.is_compiling():
            self._enter(module, args, sys._getframe(1))

    def scripted_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if module in self.hooks.scripted:
            self.post_forward(module, args, output)

    def compiled_notes(self) -> list[str]:
        """What the report says of the calls memsentry stepped aside for."""
        counting = isinstance(self._sampler.backend, StorageBackend)
        return aside_notes(self._registry.sharded if counting else set(), self.script_names,
                           self.compiled, self.other_threads) + self.saved.notes()

    def _aside(self, module: nn.Module) -> bool:
        """Whether a module call is none of memsentry's business: while Dynamo traces (a
        constant to it: nothing below is traced), while torch.jit.trace records every op, when
        not tracking, and inside a backward pass (checkpointing recomputes a forward there)."""
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None \
                or not self.active:
            return True
        if in_backward():
            self.saved.recomputing(module)
            return True
        return not self._owner.mine() and not self._adopted()

    def _adopted(self) -> bool:
        """A call from a thread not the loop's: a tracker given a model follows the thread
        that calls it first; later calls from other threads are another loop's (counted)."""
        if self._owner.adoptable and not self.stack and not self._clock.calls \
                and not self._clock.index:
            self._owner.adopt()
            return True
        self.other_threads += 1
        return False

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # a constant to Dynamo: nothing below is traced
            return
        self._enter(module, args, sys._getframe(1))

    def _enter(self, module: nn.Module, args: Any, frame: types.FrameType) -> None:
        """A module call begins; ``frame`` runs it (``Module._call_impl``). A call that is
        none of memsentry's business is left alone; one the coverage leaves out is only
        counted (an outermost one of a sampled iteration is held on the stack); any other is
        measured."""
        if self._aside(module):
            return
        started = self.coverage.clock()
        if self._sampler.backend is None:
            self._start_backend(module, args)
        parent = self._parent(module, frame)
        if parent is None:
            self._iteration_start(module)  # its census, if any, is clocked apart
            started = self.coverage.clock()
        record = self._registry.record_of(module) or self._first_call(module, parent, frame)
        coverage = self.coverage
        coverage.calls += 1
        if coverage.measures(record.index, not record.measured):
            self._measure(module, record, parent, args, frame, started)
        elif parent is None and not coverage.light:
            self._hold(module, record, args, frame, started)
        else:
            self._count_only(record, parent, args, frame, started)

    def _parent(self, module: nn.Module, frame: types.FrameType) -> LayerRecord | None:
        """The layer of the call running around ``module``'s (``None``: the call is
        outermost), once the calls whose frames are gone left the stack."""
        stack = self.stack
        if stack and self._registry.may_be_stale(module):
            self._drop_stale(frame)
        return stack[-1].record if stack else None

    def _first_call(self, module: nn.Module, parent: LayerRecord | None,
                    frame: types.FrameType) -> LayerRecord:
        """The record made at ``module``'s first call, named through the code that called it
        (``frame``): which module's own method called it, and the name the code spells it by
        (asked only where needed)."""
        return self._registry.record_for(module, parent, lambda: entered_through(module, frame)[0],
                                         lambda: spelled_name(module, frame))

    def _note_layer(self, module: nn.Module, record: LayerRecord,
                    parent: LayerRecord | None) -> None:
        """What a call that goes on the stack says of layers: its own ran compiled or as
        TorchScript (measured as a whole); outermost, it is an anchor (its calls mark
        iterations), else its parent is no leaf."""
        if compiled_original(module) is not None:
            self.compiled.add(record.name)
        elif isinstance(module, torch.jit.ScriptModule):
            self.script_names.add(record.name)
        if parent is None:
            self.hooks.anchors.add(record.index)
        else:
            parent.is_leaf = False

    def _measure(self, module: nn.Module, record: LayerRecord, parent: LayerRecord | None,
                 args: Any, frame: types.FrameType, started: float) -> None:
        """A measured call: memory sampled at its start, what it saves for backward counted
        (the saved-tensor hooks pushed, where memsentry puts them on), its backward timed."""
        self._note_layer(module, record, parent)
        pushed = self._saved and self.saved.push(record.name)
        foreign = self.saved.foreign_hooks(record.name) if self._saved else None
        allocated = self._sampler.sample()
        self._clock.module_called(args, outermost=parent is None)
        call = ForwardCall(record, allocated, allocated, measured=True, pushed=pushed,
                           hooks=foreign, frame=id(frame))
        self.stack.append(call)
        if self._backward is not None and torch.is_grad_enabled():
            call.backward = self._backward.watch_inputs(record, args)
        self.coverage.count(started)

    def _hold(self, module: nn.Module, record: LayerRecord, args: Any,
              frame: types.FrameType, started: float) -> None:
        """An outermost call of a sampled iteration left unmeasured: held on the stack (so
        that the calls inside it know their parent). Where the iteration reads the parts (the
        first iterations stopped measuring), its saved tensors are still counted, cheaply:
        they are the activations of the iteration's breakdown."""
        self._note_layer(module, record, None)
        pushed = self._parts.due and self._saved and self.saved.push(record.name)
        last = self._sampler.last
        self._clock.module_called(args, outermost=True)
        self.stack.append(ForwardCall(record, last, last, measured=False, pushed=pushed,
                                      frame=id(frame)))
        self.coverage.counted(started)

    def _count_only(self, record: LayerRecord, parent: LayerRecord | None, args: Any,
                    frame: types.FrameType, started: float) -> None:
        """A call the coverage leaves out, in a light iteration or inside another call: counted
        by the iteration's clock and by its layer. An outermost one goes on the stack, so that
        the calls inside it know their parent (its layer counts it as it ends)."""
        self._clock.module_called(args, outermost=parent is None)
        if parent is None:
            self.stack.append(ForwardCall(record, 0, 0, measured=False, frame=id(frame)))
        else:
            record.calls += 1
        self.coverage.counted(started)

    def settle_stack(self) -> None:
        """Outside any forward (a backward pass ended): no call of the stack may be stale."""
        if self.stack:
            self._drop_stale(sys._getframe(1))

    def _drop_stale(self, frame: types.FrameType) -> None:
        for call in stale_calls(self.stack, frame, self._registry.record_of):
            if call.pushed:
                self.saved.pop()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module call ends (also while an error propagates through it): a call on the stack
        leaves it, read as it ends and folded into its layer."""
        record = self._ending(module)
        if record is None:
            return
        stack = self.stack
        started = self.coverage.clock()
        # Read before the call leaves the stack: the reading raises its peak.
        allocated = self._sampler.sample() if stack[-1].measured else 0
        error = sys.exc_info()[1]  # PyTorch runs this hook while an error propagates
        if error is not None:
            self.failures.check(error, record.name, self._sampler)
        call = stack.pop()
        while call.record is not record and stack:  # a child whose post hook never ran
            call = stack.pop()
        if not call.measured and not stack and self.coverage.light:  # its boundaries count
            self._light_ended(module, record, output, started)
            return
        self._ended(module, call, allocated, output)
        if call.measured:
            self.coverage.count(started)
        else:
            self.coverage.counted(started)

    def _ending(self, module: nn.Module) -> LayerRecord | None:
        """The layer of a call that ends, when its call is on the stack; ``None`` when the end
        is none of memsentry's business (as for :meth:`_aside`, and from threads other than
        the loop's) or the call was only counted."""
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return None
        stack = self.stack
        if not self.active or not stack or in_backward() or not self._owner.mine():
            return None
        record = self._registry.record_for(module, None)
        if stack[-1].record is not record and all(c.record is not record for c in stack):
            return None  # a call that was only counted
        return record

    def _light_ended(self, module: nn.Module, record: LayerRecord, output: Any,
                     started: float) -> None:
        """An outermost call of a light iteration ended: its layer counts it; the hooks go
        bare where the census that kept them on was taken at this call, else (with autograd
        on) its graph is watched, since the end of its backward may close the iteration."""
        record.calls += 1
        passes, self.pass_after = self.pass_after, 0
        if self.unhook_after:
            self.unhook_after = False
            self.hooks.follow(bare=True)
        elif torch.is_grad_enabled():
            self._outermost.watch_light(record.name, not module.training, tensors_in(output),
                                    self._entry(module))
        elif passes and not self.compiled:  # no graph to watch: its next calls are counted
            self.hooks.count_calls(module, passes, self._owner.ident or 0, self.stop_counting)
        self.coverage.counted(started)

    def stop_counting(self) -> None:
        """The calls counted with no hook (:meth:`ModuleHooks.count_calls`) are passed
        boundaries: their layer counts them, ``on_passed`` the iterations; the hooks go back
        on."""
        counter = self.hooks.counter
        module = counter.module
        calls = self.hooks.stop_counting()
        record = self._registry.record_of(module) if module is not None else None
        if record is not None:
            record.calls += calls
        if calls:
            self.on_passed(calls)

    def _entry(self, module: nn.Module) -> Callable[[], tuple[str | None, Location | None]]:
        """What an outermost call of ``module`` was entered through, asked when its graph is
        watched: the named module whose own method called it, and the user's line."""
        frame = sys._getframe(1)

        def entry() -> tuple[str | None, Location | None]:
            owner, where = entered_through(module, frame)
            record = self._registry.record_of(owner) if owner is not None else None
            named = record.name if record is not None else self._registry.name_of(owner)
            return named, where
        return entry

    def _ended(self, module: nn.Module, call: ForwardCall, allocated: int, output: Any) -> None:
        """Fold a call that left the stack into its layer, its parent and the watches of its
        graph (``allocated``: memory read as it ended)."""
        outputs = tensors_in(output)
        self._fold(call, allocated, outputs)
        stack = self.stack
        grad = torch.is_grad_enabled()
        if not stack and grad:
            self._watch_root(module, call, outputs)
        if call.backward is not None and grad and self._backward is not None:
            self._backward.watch_outputs(call.backward, outputs)
        if call.pushed or not stack:
            self.saved.pop()

    def _fold(self, call: ForwardCall, allocated: int, outputs: list[torch.Tensor]) -> None:
        """A measured call's figures go into its layer (and its peak and saved tensors into
        its parent's call); an unmeasured one is only counted."""
        record = call.record
        if not call.measured:
            record.calls += 1
            return
        record.add_forward(
            delta=allocated - call.start, peak=call.peak - call.start,
            output=storage_bytes(outputs),
            saved=self.saved.saved_of(call) if self._saved else None,
        )
        if self.stack:
            _fold_into(self.stack[-1], call)

    def _watch_root(self, module: nn.Module, call: ForwardCall,
                    outputs: list[torch.Tensor]) -> None:
        """An outermost call ended with autograd on: its graph is watched until a backward
        reaches it (with what it saved, where that was counted)."""
        saved = call.saved_bytes if self._saved and call.measured else None
        self._outermost.watch(call.record.name, not module.training, saved, outputs,
                          self._entry(module))

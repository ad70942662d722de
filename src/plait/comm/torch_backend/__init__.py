"""plait as a torch.distributed backend: `dist.init_process_group("plait")`.

Any torch program names the backend and gets plait's engine under its collectives: a dead
or frozen rank named within seconds instead of a hang, plait's algorithms and shared memory
on CPU, plait's CUDA path for CUDA tensors, and PLAIT_TRACE's timeline.

    registration.py   register "plait" with torch (import plait, or torch's entry point)
    creator.py        torch's call to make a group: the job's engine, or a subgroup of it
    process_group.py  PlaitProcessGroup: the ProcessGroup torch calls, one method a call
    translate.py      torch's arguments (options, ReduceOp, overload forms) in plait's words
    collectives.py    each torch collective as plait calls, into torch's output tensors
    work.py           PlaitWork: the Work and the torch Future torch waits on
    observe.py        while PLAIT_TRACE records: the program's steps, forward, backward

Nothing here is imported by `import plait` unless torch.distributed is already imported;
docs/torch-backend.md is the user's page.
"""

"""
A pretokenize process's share of the units under Slurm: its task, and its array task.
A process's rank and world size from Slurm's variables, read as torchrun's are: the tasks of an
`srun` step (SLURM_PROCID of SLURM_STEP_NUM_TASKS) and the tasks of a job array
(SLURM_ARRAY_TASK_ID among SLURM_ARRAY_TASK_COUNT), both together for an array of multi-task
jobs. A batch script run without srun is one task whatever its --ntasks: Slurm sets SLURM_PROCID=0
and SLURM_NTASKS there too, and reading them would take a 1/N share with no other task to write the
rest. Recipe: docs/pretokenized.md.

May import: the standard library.
"""

from typing import NamedTuple


class SlurmShare(NamedTuple):
    """This process's share of the units, and where it came from."""
    rank: int
    world_size: int
    what: str  # for the log: "task 3 of 4 of srun's step; array task 2 of 8"


def slurm_share(environ) -> SlurmShare | None:
    """The share Slurm's variables in environ give, or None outside a step or an array. ValueError
    for an array whose ids are not a range (--array=0,3,7)."""
    tasks, task, said = 1, 0, []
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
    if step.lstrip("-").isdigit() and int(step) >= 0:  # inside srun (the batch script has none)
        tasks = _int(environ, "SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1"))
        task = _int(environ, "SLURM_PROCID", "0")
        said.append(f"task {task} of {tasks} of srun's step")
    elif _int(environ, "SLURM_NTASKS", "1") > 1:
        said.append(f"a batch script of --ntasks {environ['SLURM_NTASKS']} run without srun is one "
                    "task: it writes every unit (run it under srun to share them)")
    arrays, array = 1, 0
    if "SLURM_ARRAY_TASK_ID" in environ:
        arrays, array = _array_index(environ)
        said.append(f"array task {array} of {arrays}")
    if not said:
        return None
    return SlurmShare(array * tasks + task, arrays * tasks, "; ".join(said) +
                      f" -> rank {array * tasks + task} of {arrays * tasks}")


def _array_index(environ) -> tuple[int, int]:
    """(tasks in the array, this task's place among them): ids MIN, MIN+STEP, ..., MAX."""
    task_id = _int(environ, "SLURM_ARRAY_TASK_ID", "0")
    count = _int(environ, "SLURM_ARRAY_TASK_COUNT", "1")
    low = _int(environ, "SLURM_ARRAY_TASK_MIN", str(task_id))
    high = _int(environ, "SLURM_ARRAY_TASK_MAX", str(task_id))
    step = _int(environ, "SLURM_ARRAY_TASK_STEP", "1")
    if step < 1 or (high - low) // step + 1 != count or (task_id - low) % step:
        raise ValueError(f"Slurm array task {task_id} of ids {low}..{high} (step {step}, "
                         f"{count} tasks) is not a range of ids: submit --array=0-{count - 1} "
                         "(a %limit is fine), or pass --rank and --world-size")
    return count, (task_id - low) // step


def _int(environ, name: str, default: str) -> int:
    value = environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Slurm's {name}={value!r} is not a number") from None

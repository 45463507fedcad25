"""--save_images_epochs beside --save_images_steps: when sample grids are written."""

from _training_scripts import TINY_UNET, TRAIN_UNCONDITIONAL, run_script

from diffusers_scalelong.trainer import TrainingConfig
from diffusers_scalelong.trainer.trainer import grid_due


def due_steps(save_images_steps, save_images_epochs, steps_per_epoch=3, max_steps=12) -> list[int]:
    args = TrainingConfig(
        output_dir="unused",
        save_images_steps=save_images_steps,
        save_images_epochs=save_images_epochs,
        report_to="none",
    )
    return [s for s in range(1, max_steps + 1) if grid_due(args, s, steps_per_epoch, stop=s == max_steps)]


def test_grids_at_every_nth_epoch_end_and_the_end():
    assert due_steps(None, 1) == [3, 6, 9, 12]
    assert due_steps(None, 2) == [6, 12]
    assert due_steps(None, 5) == [12]  # only the end of the run
    assert due_steps(5, None) == [5, 10, 12]
    assert due_steps(5, 2) == [5, 6, 10, 12]
    assert due_steps(None, None) == []


def test_training_writes_a_grid_at_each_epoch_end(tmp_path):
    # 64 images at batch 8: 8 steps per epoch; two epochs
    run_script(
        TRAIN_UNCONDITIONAL, ["--output_dir", tmp_path, *TINY_UNET, "--num_epochs", "2", "--save_images_epochs", "1"]
    )
    assert sorted(p.name for p in (tmp_path / "samples").glob("*.png")) == ["step-0000008.png", "step-0000016.png"]

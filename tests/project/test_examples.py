"""The examples run as a user runs them, in 2 CPU processes.

``examples/resume_demo.py`` (the main job) launches itself with torchrun;
``save_load.py`` runs under ``accelerate launch`` with the folder's 2-GPU
config file (``--cpu`` makes its processes use the CPU); ``resume_after_kill.py``
runs through the tests' launcher, which gives each rank's exit code.
"""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

from launcher import REPO, launch

EXAMPLES = REPO / 'examples'
MULTIGPU = EXAMPLES / 'accelerate-multigpu'
TIMEOUT = 300
# the demo gives each of its 5 launches this long, then fails on its own
DEMO_LAUNCH_TIMEOUT = 150
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def _run(command, cwd=REPO, timeout=TIMEOUT):
    # the examples (and the ranks they start) import this checkout's package
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1',
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def _demo_module():
    spec = importlib.util.spec_from_file_location('resume_demo', EXAMPLES / 'resume_demo.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- resume_demo

@pytest.fixture(scope='module', params=[pytest.param('demo', marks=pytest.mark.slow)])
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp('demo')
    returncode, output = _run([sys.executable, str(EXAMPLES / 'resume_demo.py'),
                               '--nproc', '2', '--epochs', '4', '--out', str(out),
                               '--timeout', str(DEMO_LAUNCH_TIMEOUT)],
                              timeout=5 * DEMO_LAUNCH_TIMEOUT + 60)
    summary_path = out / 'summary.json'
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return dict(out=out, returncode=returncode, output=output, summary=summary)


def test_demo_verdict_is_identical(demo):
    assert demo['returncode'] == 0, demo['output'][-6000:]
    assert 'VERDICT: IDENTICAL' in demo['output']
    assert demo['summary']['verdict'] == 'identical'
    assert demo['summary']['differences'] == []
    assert demo['summary']['tensors_compared'] > 0


def test_demo_ran_distributed_and_really_killed_the_job(demo):
    summary = demo['summary']
    assert summary['nproc'] == summary['num_processes'] == 2
    assert summary['module_type'] == 'DistributedDataParallel'
    assert 'torchrun exit code -9' in demo['output']
    # killed in epoch 3 of 4, resumed from a step checkpoint inside it, which
    # leaves at most a checkpoint interval of work to redo: the checkpoint
    # callback runs last in a batch's end, so the demo may have heard of the
    # batch a save is due at, and killed the job before that save
    kill = summary['kill']
    assert kill['epoch'] == 3 and kill['stopped_at'][0] == 3
    assert re.fullmatch(r'epoch-0002-step-\d{8}', os.path.basename(kill['resumed_from']))
    assert 0 <= kill['lost_batches'] <= summary['every_n_steps']
    assert 'Resumed from' in demo['output']


def test_demo_preempts_with_sigterm_and_loses_nothing(demo):
    sigterm = demo['summary']['sigterm']
    assert sigterm['epoch'] == 2
    assert sigterm['resumed_from'] is not None and sigterm['lost_batches'] == 0
    # the signal lands inside epoch 2: its checkpoint is a step one, after
    # the batch the signal was sent at, and the relaunch continues the epoch
    assert re.fullmatch(r'epoch-0001-step-\d{8}', os.path.basename(sigterm['resumed_from']))
    stopped_epoch, stopped_batch = sigterm['stopped_at']
    assert sigterm['signalled_at'] == [2, 3]
    assert stopped_epoch == 2 and 3 <= stopped_batch < demo['summary']['batches_per_epoch']
    assert (f"Resumed from {sigterm['resumed_from']} at batch {stopped_batch} of epoch 2"
            in demo['output'])
    # the plot marks it there: epoch 2 ends at x = 2
    assert sigterm['stopped_at_epochs'] == \
        1 + stopped_batch / demo['summary']['batches_per_epoch']
    assert 'TrainingPreempted: training stopped on SIGTERM' in demo['output']
    assert re.search(r'torchrun exit code [1-9]\d*; the last batch it reported', demo['output'])
    assert f"SIGTERM {sigterm['lost_batches']} (saved at the batch it stopped at)" in \
        demo['output']


def test_demo_shows_torchruns_traceback_of_the_signal_as_one_line(demo):
    """torchrun ends a SIGTERM with a traceback of its SignalException: the
    demo says it is expected instead of echoing its 30 lines."""
    output = demo['output']
    assert re.search(r'^  run 3 \| expected: torchrun reports the signal \(SignalException: '
                     r'Process \d+ got signal: 15; its traceback of \d+ lines left out\)$',
                     output, flags=re.M)
    assert 'Traceback (most recent call last)' not in output
    assert 'SignalException' not in output.replace(
        'expected: torchrun reports the signal (SignalException', '')


def test_demo_prints_the_epoch_logs_side_by_side(demo):
    rows = re.findall(r'^\s+(\d+) \|.*\| (yes|NO)$', demo['output'], flags=re.M)
    assert [int(epoch) for epoch, _ in rows] == [1, 2, 3, 4]
    assert all(same == 'yes' for _, same in rows)
    lost = re.findall(r'>>> (SIGKILL|SIGTERM) during epoch \d.*: (\d+) batch\(es\) lost',
                      demo['output'])
    summary = demo['summary']
    assert sorted(lost) == [('SIGKILL', str(summary['kill']['lost_batches'])),
                            ('SIGTERM', '0')]


def test_demo_lists_its_checkpoints_with_the_command(demo):
    """The last step: ``python -m skorch_accel_callbacks list`` on the
    folder of the killed and relaunched run."""
    output = demo['output']
    folder = demo['out'] / 'killed-and-relaunched' / 'checkpoints'
    step = output[output.index('7/7 The checkpoints'):]
    assert f"  $ python -m skorch_accel_callbacks list {folder}\n" in step
    assert f"  {folder}: 3 checkpoint(s), in training order" in step
    # the one resumed from (kept while that run trained), then the newest two:
    # epoch 4 holds steps 70-92 (23 batches an epoch)
    rows = re.findall(r'^\s+(epoch-\d{4}(?:-step-\d{8})?)\s+(\d+)\s+(\d+)\s.*\s(\S+)$', step,
                      flags=re.M)
    resumed = os.path.basename(demo['summary']['kill']['resumed_from'])
    assert [row[0] for row in rows] == [resumed, 'epoch-0003-step-00000090', 'epoch-0004']
    assert [row[1:] for row in rows[1:]] == [('3', '90', 'ok'), ('4', '92', 'ok')]
    assert 'left over: nothing' in step  # the kill's partial folder was removed
    assert re.search(r'lock: free \(last taken by pid \d+ on host', step)


def test_demo_writes_a_valid_png(demo):
    import matplotlib.image
    path = demo['out'] / 'loss_curves.png'
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert data[12:16] == b'IHDR'
    width, height = struct.unpack('>II', data[16:24])
    image = matplotlib.image.imread(path)  # decodes every chunk
    assert image.shape[:2] == (height, width) and width > 300 and height > 200


def test_demo_comparison_catches_a_one_ulp_difference(demo):
    """The verdict can say 'differs': one parameter one float step away is found."""
    module = _demo_module()
    runs = demo['out']
    full = module._load(str(runs / 'uninterrupted'))
    resumed = module._load(str(runs / 'killed-and-relaunched'))
    assert module.compare(full, resumed)[0] == []
    weight = resumed['state']['module']['out.weight']
    weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float('inf')))
    differences, _ = module.compare(full, resumed)
    assert len(differences) == 1 and differences[0].startswith('module.out.weight differs')


def test_demo_refuses_a_kill_epoch_outside_the_run(tmp_path, capsys):
    module = _demo_module()
    assert module.main(['--epochs', '3', '--kill-epoch', '5', '--out', str(tmp_path)]) == 2
    assert '--kill-epoch must be between 2 and --epochs (3)' in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing launched, nothing written


# ---------------------------------------------------------------- resume_demo --store s3

@pytest.fixture(scope='module', params=[pytest.param('demo-s3', marks=pytest.mark.slow)])
def demo_s3(tmp_path_factory):
    """``make demo-s3``, 2 epochs: the preempted run against the demo's own
    local S3 server, relaunched without its staging folder."""
    out = tmp_path_factory.mktemp('demo-s3')
    returncode, output = _run([sys.executable, str(EXAMPLES / 'resume_demo.py'),
                               '--store', 's3', '--nproc', '2', '--epochs', '2',
                               '--out', str(out), '--timeout', str(DEMO_LAUNCH_TIMEOUT)],
                              timeout=3 * DEMO_LAUNCH_TIMEOUT + 60)
    summary_path = out / 'summary.json'
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return dict(out=out, returncode=returncode, output=output, summary=summary)


def test_demo_s3_resumes_a_preempted_run_on_a_new_machine_from_the_bucket(demo_s3):
    output, summary = demo_s3['output'], demo_s3['summary']
    assert demo_s3['returncode'] == 0, output[-6000:]
    assert 'VERDICT: IDENTICAL' in output
    assert summary['verdict'] == 'identical' and summary['differences'] == []
    assert summary['store'] == 's3' and summary['kill'] is None
    assert summary['nproc'] == summary['num_processes'] == 2
    # the checkpoint taken on the signal was in the bucket when the job had
    # exited; its staging folder was deleted before the relaunch, which
    # downloaded it into a new one
    taken = re.search(r'the checkpoint taken on the signal: (epoch-0000-step-\d{8})\n', output)
    assert taken, output[-6000:]
    url = 's3://skorch-demo/preempted-and-relaunched'
    assert f"uploaded before the job exited: {url}/latest.json names {taken[1]}" in output
    staging = demo_s3['out'] / 'preempted-and-relaunched' / 'staging'
    deleted = output.index(f"deleted the staging folder {staging}, as on a new machine")
    sigterm = summary['sigterm']
    assert sigterm['resumed_from'] == f'{url}/{taken[1]}'
    assert output.index(f"Resumed from {sigterm['resumed_from']} at batch") > deleted
    assert sigterm['lost_batches'] == 0
    assert f"Saved checkpoint {url}/epoch-0002 (finished)" in output


def test_demo_s3_lists_the_runs_checkpoints_in_the_bucket(demo_s3):
    output = demo_s3['output']
    url = 's3://skorch-demo/preempted-and-relaunched'
    step = output[output.index('5/5 The checkpoints of the preempted and relaunched run'):]
    assert f"  $ python -m skorch_accel_callbacks list {url}\n" in step
    assert f"  {url}: 3 checkpoint(s), in training order" in step
    rows = re.findall(r'^\s+(epoch-\d{4}(?:-step-\d{8})?)\s.*\s(\S+)$', step, flags=re.M)
    resumed = os.path.basename(demo_s3['summary']['sigterm']['resumed_from'])
    # the one resumed from (kept while the relaunch trained), the newest two
    assert rows == [(resumed, 'ok'), ('epoch-0001-step-00000040', 'ok'), ('epoch-0002', 'ok')]
    assert 'pointers: latest.json -> epoch-0002' in step


# ---------------------------------------------------------------- accelerate-multigpu

def test_multigpu_config_is_a_two_process_multi_gpu_config():
    from accelerate.commands.config.config_args import load_config_from_file
    config = load_config_from_file(str(MULTIGPU / 'accelerate_config.yaml'))
    assert config.distributed_type.value == 'MULTI_GPU'
    assert config.num_processes == 2 and config.num_machines == 1
    assert not config.use_cpu


@pytest.mark.slow
def test_save_load_every_combination_predicts_identically(tmp_path):
    returncode, output = _run(
        [sys.executable, '-m', 'accelerate.commands.launch',
         '--config_file', 'accelerate_config.yaml', '--main_process_port', '0',
         'save_load.py', '--cpu', '--epochs', '1', '--out', str(tmp_path)],
        cwd=MULTIGPU)
    assert returncode == 0, output[-6000:]
    assert 'trained 1 epochs in 2 process(es)' in output
    lines = [line for line in output.splitlines()
             if line.startswith(('ParamsCheckpoint ', 'TrainEndParamsCheckpoint '))]
    assert len(lines) == 6, output[-3000:]
    assert all(line.endswith(' identical') for line in lines)
    # saved from the DDP-wrapped module and from the unwrapped one, no prefix
    assert 'DistributedDataParallel no' in lines[0]
    assert re.search(r'^TrainEndParamsCheckpoint\s+MLP\s+no ', lines[3])
    assert 'VERDICT: IDENTICAL' in output


def _sha(result):
    found = re.findall(r'final parameters sha256: ([0-9a-f]{64})', result.outputs[0])
    assert len(found) == 1, result.report()
    return found[0]


@pytest.mark.slow
def test_resume_after_kill_matches_the_uninterrupted_run(tmp_path):
    script = MULTIGPU / 'resume_after_kill.py'
    common = ('--cpu', '--epochs', '4')
    full = launch(script, *common, '--dirname', tmp_path / 'full',
                  timeout=TIMEOUT).check()
    killed = launch(script, *common, '--dirname', tmp_path / 'killed',
                    '--die-in-epoch', '3', timeout=TIMEOUT)
    assert killed.returncodes == [-9, -9], killed.report()
    assert 'killing every process (SIGKILL) after batch 2 of epoch 3' in killed.outputs[0]
    resumed = launch(script, *common, '--dirname', tmp_path / 'killed',
                     timeout=TIMEOUT).check()
    assert 'Resumed from' in resumed.outputs[0] and 'after epoch 2' in resumed.outputs[0]
    assert 'trained 4 epochs in 2 process(es)' in resumed.outputs[0]
    assert _sha(resumed) == _sha(full)

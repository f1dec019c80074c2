<?php

// Task classes that end in every way a task can, for the runner's tests. Each
// reads what it needs from its task data.

final class StandinSucceedWorker extends PhabricatorWorker {
  protected function doWork() {
    // A dependency that fails 'flake' percent of its calls, or every call while the
    // file 'outage' names exists (the canary's shared-outage test).
    if (mt_rand(0, 99) < (int)$this->getTaskDataValue('flake', 0)) {
      throw new Exception('standin flake');
    }
    $outage = $this->getTaskDataValue('outage');
    if ($outage && file_exists($outage)) {
      throw new Exception('standin outage');
    }
    foreach ($this->getTaskDataValue('followups', array()) as $followup) {
      $this->queueTask($followup['class'], $followup['data'], idx($followup, 'options', array()));
    }
  }
}

// Says which process ran it (as a follow-up's data), for tests of the pool.
final class StandinPidWorker extends PhabricatorWorker {
  protected function doWork() {
    $this->queueTask('StandinSucceedWorker', array('pid' => getmypid()));
  }
}

final class StandinSleepWorker extends PhabricatorWorker {
  protected function doWork() {
    usleep((int)$this->getTaskDataValue('ms', 100) * 1000);
    $this->queueTask('StandinSucceedWorker', array('pid' => getmypid()));
  }
}

final class StandinFailWorker extends PhabricatorWorker {
  public function getWaitBeforeRetry(PhabricatorWorkerTask $task) {
    return $this->getTaskDataValue('wait');
  }

  public function getMaximumRetryCount() {
    return $this->getTaskDataValue('maximumRetries');
  }

  protected function doWork() {
    $message = $this->getTaskDataValue('message', 'standin failure');
    $message = str_repeat($message, (int)$this->getTaskDataValue('repeat', 1));
    if ($this->getTaskDataValue('invalidUTF8')) {
      $message = "\xFF".$message;
    }
    throw new Exception($message);
  }
}

final class StandinPermanentWorker extends PhabricatorWorker {
  protected function doWork() {
    throw new PhabricatorWorkerPermanentFailureException('standin gives up');
  }
}

final class StandinYieldWorker extends PhabricatorWorker {
  protected function doWork() {
    throw new PhabricatorWorkerYieldException($this->getTaskDataValue('seconds', 1));
  }
}

// Prints everywhere a PHP task can print, then succeeds.
final class StandinPrintWorker extends PhabricatorWorker {
  protected function doWork() {
    echo "echoed by the task\n";
    fwrite(STDOUT, "written to stdout\n");
    fwrite(STDERR, "written to stderr\n");
  }
}

// Fails when a previous task's request cache is still there.
final class StandinCacheWorker extends PhabricatorWorker {
  protected function doWork() {
    $left = PhabricatorCaches::getRequestCache();
    PhabricatorCaches::setRequestCache('standin', getmypid());
    if ($left) {
      throw new Exception('the request cache was not destroyed before this task');
    }
  }
}

// Its wait depends on the failure count Phorge shows it (one more than before).
final class StandinFatalWorker extends PhabricatorWorker {
  public function getWaitBeforeRetry(PhabricatorWorkerTask $task) {
    return 60 + (int)$task->getFailureCount();
  }

  protected function doWork() {
    // A compile error: fatal, no Throwable to catch.
    eval('function standin_twice() {} function standin_twice() {}');
  }
}

final class StandinExitWorker extends PhabricatorWorker {
  protected function doWork() {
    echo "about to exit\n";
    exit(3);
  }
}

final class StandinSegfaultWorker extends PhabricatorWorker {
  protected function doWork() {
    posix_kill(getmypid(), SIGSEGV);
    usleep(10000000);
  }
}

// Its process killed from outside, as the OOM killer does: SIGKILL, no PHP error.
final class StandinKilledWorker extends PhabricatorWorker {
  protected function doWork() {
    posix_kill(getmypid(), SIGKILL);
    usleep(10000000);
  }
}

final class StandinMemoryWorker extends PhabricatorWorker {
  protected function doWork() {
    ini_set('memory_limit', '48M');
    $hog = array();
    while (true) {
      $hog[] = str_repeat('x', 1048576);
    }
  }
}

final class StandinLoopWorker extends PhabricatorWorker {
  public function getRequiredLeaseTime() {
    return $this->getTaskDataValue('lease');
  }

  protected function doWork() {
    while (true) {
    }
  }
}

// Grows its process by the given megabytes and keeps them (a leaking worker).
final class StandinLeakWorker extends PhabricatorWorker {
  private static $kept = array();

  protected function doWork() {
    self::$kept[] = str_repeat('x', (int)$this->getTaskDataValue('mb', 1) * 1048576);
  }
}

abstract class StandinAbstractWorker extends PhabricatorWorker {}

final class StandinNotAWorker {}

<?php

/**
 * phorge-bridge: a taskmaster daemon that honours the canary's
 * weights. Run it in place of Phorge's own taskmasters, under the systemd
 * unit phorge-bridge ships (deploy/systemd/phorge-bridge-queue-daemon@.service):
 *
 *   ./bin/config set phd.taskmasters 0      (then restart phd)
 *   systemctl enable --now phorge-bridge-queue-daemon@{1..4}
 *
 * The unit runs it with Phorge's own scripts/daemon/exec/exec_daemon.php and
 * the argument --standalone, outside phd's overseer: "bin/phd start",
 * "restart" and "stop" only see and start overseers (phd-daemon processes),
 * and "start" starts a fixed set of daemons, so no overseer of phd's can
 * keep this one running. Standalone, it lists itself in Phorge's daemon log
 * (its Daemons console) as the overseer would list it, never hibernates, and
 * stops cleanly on SIGINT (the unit's KillSignal). "./bin/phd launch
 * PhorgeBridgeQueueDaemon" (or "debug", in the foreground) still works for a
 * try; its name holds no "taskmaster", so "./bin/phd debug taskmaster" still
 * names Phorge's own alone.
 *
 * It works like PhabricatorTaskmasterDaemon: it leases one task at a time, in
 * Phorge's two phases, runs it with PhabricatorWorkerActiveTask::executeTask()
 * (so every outcome is recorded exactly as Phorge records it), and sleeps a
 * second when there is nothing to do. But it leaves alone the rows the
 * weights (phorge-bridge.canary, PhorgeBridgeCanary.php) give to the bridge,
 * and takes everything else: the classes the bridge does not run, and the
 * old side's share of those it shares.
 *
 * Where it differs from Phorge's taskmaster, it does as the bridge does (the
 * bridge's docs/architecture.md):
 *
 *   - a delayed task (no owner, expiry in the future) waits for its time;
 *   - the lease owner is "phd:<pid>:<epoch>:<host>:<seq>" (the epoch the
 *     database's clock), "phd-fallback:..." for a row that fell back from the
 *     bridge (failureTime set, failureCount 0), so the archive tells who ran
 *     each task;
 *   - a task's temporary failure is logged and the daemon goes on (Phorge's
 *     taskmaster exits and is restarted by the overseer); so does any other
 *     error, which is logged.
 *
 * PhabricatorTaskmasterDaemon and PhabricatorWorkerLeaseQuery are final, so
 * the lease is written here on Phorge's public pieces. Installed next to
 * PhorgeBridgeCanary.php by "phorge-bridge phorge install-extension"; Phorge
 * includes src/extensions/ into its class map, so bin/phd finds the daemon by
 * name. Do not edit the installed copy. Written for PHP 7.2 (Phorge's
 * minimum).
 */
require_once dirname(__FILE__).'/PhorgeBridgeCanary.php';

final class PhorgeBridgeQueueDaemon extends PhabricatorDaemon {

  const LABEL = 'phd';
  const FALLBACK_LABEL = 'phd-fallback';
  const OWNER_BYTES = 64;

  const PHASE_UNLEASED = 'unleased';
  const PHASE_EXPIRED = 'expired';

  const STANDALONE = '--standalone';

  private $canary;

  protected function run() {
    $this->canary = new PhorgeBridgeCanary();
    $listing = null;
    if ($this->isStandalone()) {
      $listing = new PhorgeBridgeDaemonListing(__CLASS__, $this->getArgv());
    }

    do {
      PhabricatorCaches::destroyRequestCache();
      if ($listing) {
        $listing->beat();
      }

      $task = null;
      $raced = false;
      try {
        $task = self::leaseTask($this->canary->refresh(), $raced);
      } catch (Throwable $ex) {
        phlog(
          new Exception(
            pht('%s could not lease a task.', __CLASS__),
            0,
            $ex));
      }

      if ($task) {
        $this->willBeginWork();
        $this->executeLeasedTask($task);
        $sleep = 0;
      } else if ($raced) {
        // Another taskmaster took the row we chose: there may be more.
        $sleep = 0;
      } else {
        // As PhabricatorTaskmasterDaemon: the last daemon of a pool
        // hibernates after a while (the overseer module below wakes it up
        // when there is work for it), the others scale down.
        // Standalone, nothing would wake it: it stays up.
        if (!$listing && $this->getIdleDuration() > 15) {
          $hibernate_duration = phutil_units('3 minutes in seconds');
          if ($this->shouldHibernate($hibernate_duration)) {
            break;
          }
        }
        $this->willBeginIdle();
        $sleep = 1;
      }

      $this->sleep($sleep);
    } while (!$this->shouldExit());

    if ($listing) {
      $listing->exited();
    }
  }

  private function isStandalone() {
    return in_array(self::STANDALONE, $this->getArgv(), true);
  }

  private function executeLeasedTask(PhabricatorWorkerActiveTask $task) {
    $id = $task->getID();
    $class = $task->getTaskClass();
    $this->log(
      pht(
        'Working on task %d (%s) as %s...',
        $id,
        $class,
        $task->getLeaseOwner()));

    try {
      $task = $task->executeTask();
    } catch (Throwable $ex) {
      // Not the task's own failure (executeTask() records those): the lease
      // ran out, the database went away, or its follow-up tasks could not
      // be queued after it was archived. The row is left as it is.
      phlog(
        new Exception(
          pht('Error while executing task %d (%s).', $id, $class),
          0,
          $ex));
      return;
    }

    $ex = $task->getExecutionException();
    if (!$ex) {
      $this->log(pht('Task %d complete! Moved to archive.', $id));
    } else if ($ex instanceof PhabricatorWorkerPermanentFailureException) {
      phlog(
        new Exception(
          pht(
            'Task "%s" encountered a permanent failure and was cancelled.',
            $id),
          0,
          $ex));
    } else if ($ex instanceof PhabricatorWorkerYieldException) {
      $this->log(pht('Task %s yielded.', $id));
    } else {
      phlog(
        new Exception(
          pht(
            'Task %d (%s) failed; it will be retried.',
            $id,
            $class),
          0,
          $ex));
    }
  }


/* -(  The lease  )---------------------------------------------------------- */


  /**
   * Lease one task the old side may run, as PhabricatorWorkerLeaseQuery does
   * with a limit of 1: the first due unleased row (priority, id), else the
   * row whose lease expired first. Returns the task with its data, or null;
   * $raced says whether a row was chosen but another leaser took it first.
   */
  public static function leaseTask(PhorgeBridgeCanary $canary, &$raced) {
    $raced = false;
    $table = new PhabricatorWorkerActiveTask();
    $conn = $table->establishConnection('w');

    $share = $canary->newOldSideCondition($conn);
    if ($share === null) {
      // The bridge takes every class: nothing is ours.
      return null;
    }

    foreach (array(self::PHASE_UNLEASED, self::PHASE_EXPIRED) as $phase) {
      // As Phorge: SELECT the candidate, then take it with an UPDATE that
      // repeats the condition; only a row the UPDATE changed is ours.
      $row = self::selectCandidate($conn, $phase, $share);
      if (!$row) {
        continue;
      }

      $owner = self::newLeaseOwner($row);
      queryfx(
        $conn,
        'UPDATE %T SET leaseOwner = %s, leaseExpires = UNIX_TIMESTAMP() + %d
          WHERE %Q',
        $table->getTableName(),
        $owner,
        PhabricatorWorkerLeaseQuery::getDefaultLeaseDuration(),
        self::newTakeCondition($conn, $phase, $row));
      if (!$conn->getAffectedRows()) {
        $raced = true;
        continue;
      }

      $task = self::loadLeasedTask($conn, $owner);
      if ($task) {
        $raced = false;
        return $task;
      }
    }

    return null;
  }

  /**
   * The first row of a phase that the old side may run, in Phorge's order.
   *
   * One statement, as Phorge's (the optimizer reads key_owner or
   * leaseExpires in order and stops at the first row the weights give to
   * the old side; or, for a few named classes, their rows through the
   * taskClass index). What it cannot avoid: with only a few classes named at
   * the old side, every unleased row of the bridge's classes ahead of theirs
   * is read past, so a large backlog left by a stopped bridge makes each
   * lease (and each idle poll) read through it.
   */
  private static function selectCandidate(
    AphrontDatabaseConnection $conn,
    $phase,
    PhutilQueryString $share) {

    $table = new PhabricatorWorkerActiveTask();
    return queryfx_one(
      $conn,
      'SELECT id, leaseOwner, failureTime, failureCount,
          UNIX_TIMESTAMP() AS serverTime
        FROM %T WHERE %Q AND %Q %Q LIMIT 1',
      $table->getTableName(),
      self::newPhaseCondition($conn, $phase),
      $share,
      self::newPhaseOrder($conn, $phase));
  }

  /**
   * Whether there is a row leaseTask() would take now (the overseer asks,
   * to wake a hibernating pool).
   */
  public static function hasTaskToLease(PhorgeBridgeCanary $canary) {
    $table = new PhabricatorWorkerActiveTask();
    $conn = $table->establishConnection('r');
    $share = $canary->newOldSideCondition($conn);
    if ($share === null) {
      return false;
    }
    $row = queryfx_one(
      $conn,
      'SELECT id FROM %T WHERE (%Q OR %Q) AND %Q LIMIT 1',
      $table->getTableName(),
      self::newPhaseCondition($conn, self::PHASE_UNLEASED),
      self::newPhaseCondition($conn, self::PHASE_EXPIRED),
      $share);
    return (bool)$row;
  }

  // Phase 1, unleased and due (the bridge honours delays; Phorge's query
  // does not look at leaseExpires here). Phase 2, owned and expired (a lease
  // of a dead worker, a retry wait or a yield that ran out); a row without an
  // owner is phase 1's once it is due.
  private static function newPhaseCondition(
    AphrontDatabaseConnection $conn,
    $phase) {

    switch ($phase) {
      case self::PHASE_UNLEASED:
        return qsprintf(
          $conn,
          'leaseOwner IS NULL
            AND (leaseExpires IS NULL OR leaseExpires <= UNIX_TIMESTAMP())');
      case self::PHASE_EXPIRED:
        return qsprintf(
          $conn,
          'leaseOwner IS NOT NULL AND leaseExpires < UNIX_TIMESTAMP()');
    }
    throw new Exception(pht('Unknown phase "%s"!', $phase));
  }

  // Phorge's orders: new tasks by priority, then FIFO; expired ones by their
  // expiry, so a task that keeps failing goes to the back.
  private static function newPhaseOrder(
    AphrontDatabaseConnection $conn,
    $phase) {

    if ($phase === self::PHASE_UNLEASED) {
      return qsprintf($conn, 'ORDER BY priority ASC, id ASC');
    }
    return qsprintf($conn, 'ORDER BY leaseExpires ASC');
  }

  // The UPDATE's guard: the row as the SELECT saw it. Phase 1 repeats "no
  // owner, due"; phase 2 the owner seen (never "= NULL", which matches
  // nothing) and the expiry. Both repeat the failure columns, so the owner's
  // label (fallback or not) is the one the row had when it was taken.
  private static function newTakeCondition(
    AphrontDatabaseConnection $conn,
    $phase,
    array $row) {

    $parts = array(
      qsprintf($conn, 'id = %d', $row['id']),
      self::newPhaseCondition($conn, $phase),
      qsprintf($conn, 'failureCount = %d', $row['failureCount']),
    );
    if ($phase === self::PHASE_EXPIRED) {
      $parts[] = qsprintf($conn, 'leaseOwner = %s', $row['leaseOwner']);
    }
    if ($row['failureTime'] === null) {
      $parts[] = qsprintf($conn, 'failureTime IS NULL');
    } else {
      $parts[] = qsprintf($conn, 'failureTime = %d', $row['failureTime']);
    }
    return qsprintf($conn, '%LA', $parts);
  }

  /**
   * The leased row with its data, as PhabricatorWorkerLeaseQuery loads it:
   * the server's clock (for the lease checks of executeTask()) and the data
   * decoded as Phorge decodes it.
   */
  private static function loadLeasedTask(
    AphrontDatabaseConnection $conn,
    $owner) {

    $task_table = new PhabricatorWorkerActiveTask();
    $taskdata_table = new PhabricatorWorkerTaskData();

    $data = queryfx_all(
      $conn,
      'SELECT task.*, taskdata.data _taskData, UNIX_TIMESTAMP() _serverTime
        FROM %T task LEFT JOIN %T taskdata
          ON taskdata.id = task.dataID
        WHERE task.leaseOwner = %s AND task.leaseExpires > UNIX_TIMESTAMP()',
      $task_table->getTableName(),
      $taskdata_table->getTableName(),
      $owner);
    if (!$data) {
      return null;
    }

    $row = head($data);
    $task = $task_table->loadFromArray($row);
    $task->setServerTime($row['_serverTime']);
    // As Phorge (an empty or "0" data column reads as null there too).
    if ($row['_taskData']) {
      $task->setData(json_decode($row['_taskData'], true));
    } else {
      $task->setData(null);
    }
    return $task;
  }

  /**
   * "phd:<pid>:<epoch>:<host>:<seq>" (at most 64 bytes: only the host is
   * cut), "phd-fallback:..." when the row fell back from the bridge: it has
   * a failureTime but no failure. The epoch is the database's clock.
   */
  public static function newLeaseOwner(array $row) {
    static $sequence = 0;

    $fallback = ($row['failureTime'] !== null &&
      (int)$row['failureCount'] === 0);
    $label = $fallback ? self::FALLBACK_LABEL : self::LABEL;

    $head = $label.':'.getmypid().':'.(int)$row['serverTime'].':';
    $tail = ':'.(++$sequence);
    $room = max(1, self::OWNER_BYTES - strlen($head) - strlen($tail));

    // The owner's fields are ":"-separated; a host name has none anyway.
    $host = str_replace(':', '.', php_uname('n'));
    $host = id(new PhutilUTF8StringTruncator())
      ->setMaximumBytes($room)
      ->setTerminator('')
      ->truncateString($host);

    return $head.$host.$tail;
  }

}


/**
 * A standalone PhorgeBridgeQueueDaemon's row in Phorge's daemon log, written
 * as phd's overseer writes its daemons' rows (PhabricatorDaemonEventListener):
 * listed at start, its dateModified refreshed by a heartbeat, "exit" at a
 * clean stop. The console then shows it with host, pid and user, and calls
 * it unknown, then dead, when the heartbeat stops; doctor and the setup check
 * count it alive by that heartbeat. The heartbeat comes between tasks: one
 * task running for over 6 minutes shows it as unknown until it ends. A
 * failing write is logged once and the daemon works on: the row is a
 * courtesy to Phorge's screens, not part of running tasks.
 */
final class PhorgeBridgeDaemonListing extends Phobject {

  // Half of phd's 120 s, so one late beat never shows the daemon as unknown.
  const HEARTBEAT = 60;

  private $log;
  private $failing = false;
  private $nextBeat = 0;

  public function __construct($daemon_class, array $argv) {
    $user = posix_getpwuid(posix_geteuid());
    $this->log = id(new PhabricatorDaemonLog())
      ->setDaemonID('phorge-bridge-'.Filesystem::readRandomCharacters(12))
      ->setDaemon($daemon_class)
      ->setHost(php_uname('n'))
      ->setPID(getmypid())
      ->setRunningAsUser($user['name'])
      ->setStatus(PhabricatorDaemonLog::STATUS_RUNNING)
      ->setArgv($argv)
      ->setExplicitArgv($argv);
  }

  /**
   * Lists the daemon, or refreshes its heartbeat once HEARTBEAT seconds have
   * passed since the last write.
   */
  public function beat() {
    if (time() < $this->nextBeat) {
      return;
    }
    $this->nextBeat = time() + self::HEARTBEAT;
    $this->write();
  }

  public function exited() {
    $this->log->setStatus(PhabricatorDaemonLog::STATUS_EXITED);
    $this->write();
  }

  private function write() {
    try {
      $this->log->save();
    } catch (Throwable $ex) {
      if (!$this->failing) {
        phlog(
          new Exception(
            pht(
              '%s could not write its row in the daemon log; it works on '.
              'and tries again with each heartbeat.',
              $this->log->getDaemon()),
            0,
            $ex));
      }
      $this->failing = true;
      return;
    }
    if ($this->failing) {
      phlog(
        pht(
          '%s is listed in the daemon log again.',
          $this->log->getDaemon()));
    }
    $this->failing = false;
  }

}


/**
 * Wakes a hibernating pool of PhorgeBridgeQueueDaemon when there is a
 * task for it, as PhabricatorTaskmasterDaemonModule does for Phorge's own
 * taskmasters (which it alone knows).
 */
final class PhorgeBridgeQueueDaemonModule
  extends PhutilDaemonOverseerModule {

  private $canary;

  public function shouldWakePool(PhutilDaemonPool $pool) {
    $class = $pool->getPoolDaemonClass();
    if ($class != 'PhorgeBridgeQueueDaemon') {
      return false;
    }

    // Once a second per pool ("phd launch 4 ..." makes four pools of one).
    if ($this->shouldThrottle($class.':'.spl_object_hash($pool), 1)) {
      return false;
    }

    if (!$this->canary) {
      $this->canary = new PhorgeBridgeCanary();
    }

    try {
      return PhorgeBridgeQueueDaemon::hasTaskToLease(
        $this->canary->refresh());
    } catch (Throwable $ex) {
      phlog($ex);
      return false;
    }
  }

}


/**
 * Phorge's setup issues, for an install whose queue phorge-bridge runs:
 *
 *   - "phorge-bridge.old-side-not-running": the weights give phd a share and
 *     no PhorgeBridgeQueueDaemon is alive (bin/phd start and restart do not
 *     start it; its systemd unit does), so that share waits;
 *   - "phorge-bridge.queue-not-running": nothing runs the queue, neither a
 *     taskmaster, nor a PhorgeBridgeQueueDaemon, nor a bridge beat (the
 *     holder of the bridge's beat lock). Raised only while Phorge's own
 *     "daemons.not-running" is ignored (config.ignore-issues), as the bridge's
 *     docs say to do once it runs the queue: Phorge's check knows only its
 *     taskmasters.
 *
 * Daemons count as Phorge's daemon console counts them (a live heartbeat).
 */
final class PhorgeBridgeQueueSetupCheck extends PhabricatorSetupCheck {

  public function getDefaultGroup() {
    return self::GROUP_IMPORTANT;
  }

  protected function executeChecks() {
    try {
      $alive = id(new PhabricatorDaemonLogQuery())
        ->setViewer(PhabricatorUser::getOmnipotentUser())
        ->withStatus(PhabricatorDaemonLogQuery::STATUS_ALIVE)
        ->withDaemonClasses(
          array('PhabricatorTaskmasterDaemon', 'PhorgeBridgeQueueDaemon'))
        ->execute();
      // Read as the daemon reads it; unreadable, it names no share.
      $canary = id(new PhorgeBridgeCanary())->refresh();
      $beat = self::isBeatRunning();
    } catch (Exception $ex) {
      // As Phorge's own daemon check: skip when it can not tell.
      return;
    }
    $running = array_fuse(mpull($alive, 'getDaemon'));

    $daemon = isset($running['PhorgeBridgeQueueDaemon']);
    if (!$daemon && $canary->givesPhdAShare()) {
      $this->newIssue('phorge-bridge.old-side-not-running')
        ->setShortName(pht('Queue Daemon Not Running'))
        ->setName(pht('PhorgeBridgeQueueDaemon Is Not Running'))
        ->setSummary(
          pht(
            'The canary gives phd a share of the queue, and no '.
            'PhorgeBridgeQueueDaemon runs it.'))
        ->setMessage(
          pht(
            'The weights in %s leave some tasks to phd, and only the '.
            'PhorgeBridgeQueueDaemon that phorge-bridge ships runs them. '.
            '%s and %s do not start it: its systemd unit does, at boot and '.
            'whenever it exits (phorge-bridge\'s %s).',
            phutil_tag('tt', array(), PhorgeBridgeCanary::OPTION),
            phutil_tag('tt', array(), 'bin/phd start'),
            phutil_tag('tt', array(), 'bin/phd restart'),
            phutil_tag(
              'tt',
              array(),
              'deploy/systemd/phorge-bridge-queue-daemon@.service')))
        ->addCommand(
          hsprintf(
            '<samp>$</samp><kbd>%s</kbd>',
            'sudo systemctl enable --now phorge-bridge-queue-daemon@1'));
    }

    $ignored = PhabricatorEnv::getEnvConfig('config.ignore-issues');
    if ($running || $beat || !idx($ignored, 'daemons.not-running')) {
      return;
    }
    $this->newIssue('phorge-bridge.queue-not-running')
      ->setShortName(pht('Queue Not Running'))
      ->setName(pht('Nothing Runs the Task Queue'))
      ->setSummary(
        pht(
          'No phorge-bridge beat, no PhorgeBridgeQueueDaemon and no '.
          'taskmaster is running: no background task runs.'))
      ->setMessage(
        pht(
          'Mail, search indexing, feed and repository imports wait. '.
          'Start the bridge (celery beat and its workers; %s says what it '.
          'misses), or the daemons with %s.',
          phutil_tag('tt', array(), 'phorge-bridge doctor'),
          phutil_tag('tt', array(), 'bin/phd start')));
  }

  /**
   * Whether a bridge beat holds its beat lock on the worker database: the
   * MySQL named lock "phorge-bridge:<database>:<owner prefix>:beat", freed
   * by the server when the beat's session ends.
   */
  private static function isBeatRunning() {
    $conn = id(new PhabricatorWorkerActiveTask())->establishConnection('w');
    $database = queryfx_one($conn, 'SELECT DATABASE() AS db');
    $prefix = PhabricatorEnv::getEnvConfig(
      PhorgeBridgeCanary::OWNER_PREFIX_OPTION);
    $key = substr('phorge-bridge:'.$database['db'].':'.$prefix.':beat', 0, 64);
    $holder = queryfx_one($conn, 'SELECT IS_USED_LOCK(%s) AS holder', $key);
    return ($holder['holder'] !== null);
  }

}

<?php

/**
 * phorge-bridge: run one leased task's worker in this PHP process and report
 * how it ended, without touching the queue tables (the bridge holds the lease
 * and records the outcome itself).
 *
 * The one implementation behind both of the bridge's ways into PHP: the
 * worker.execute Conduit method (PhorgeBridgeConduitAPIMethods.php) and the
 * long-lived runner on the worker host (phorge-bridge-runner.php). Installed
 * next to the Conduit methods by "phorge-bridge phorge install-extension";
 * do not edit the installed copy.
 *
 * The declarations are conditional: the runner loads the copy shipped with
 * the bridge before Phorge's bootstrap includes src/extensions/, so a runner
 * always runs the code its Python side expects, whatever copy is installed.
 *
 * Written for PHP 7.2 (Phorge's minimum).
 */
if (!class_exists('PhorgeBridgeTaskRun', false)) {

/**
 * A task spec that PhorgeBridgeTaskRun::newTaskFromSpec() refuses; the
 * message names the field. Each caller reports it its own way (worker.execute
 * as an ERR-BRIDGE-PARAMETER error, the runner as an "error" answer).
 */
final class PhorgeBridgeTaskSpecException extends Exception {}

final class PhorgeBridgeTaskRun {

  const RESULT_SUCCESS = 'success';
  const RESULT_YIELD = 'yield';
  const RESULT_PERMANENT_FAILURE = 'permanent-failure';
  const RESULT_FAILURE = 'failure';

  const MESSAGE_BYTES = 4096;
  const MINIMUM_YIELD = 5;

  /**
   * The task a spec describes: the map the bridge sends for each task
   * (taskID, taskClass, data as the raw JSON string of its worker_taskdata
   * row, failureCount, priority, objectPHID, containerPHID; its traceparent
   * is not read here). The one place a spec is read and checked, for
   * worker.execute and the runner alike; a malformed spec throws
   * PhorgeBridgeTaskSpecException.
   */
  public static function newTaskFromSpec(array $spec) {
    $task_id = self::readSpecInteger($spec, 'taskID', 1);
    $failure_count = self::readSpecInteger($spec, 'failureCount', 0);
    $priority = self::readSpecInteger($spec, 'priority', 0);
    $object_phid = self::readSpecOptionalString($spec, 'objectPHID');
    $container_phid = self::readSpecOptionalString($spec, 'containerPHID');

    $task_class = idx($spec, 'taskClass');
    if (!is_string($task_class) || !strlen($task_class)) {
      throw new PhorgeBridgeTaskSpecException(
        pht('Parameter "taskClass" must be a non-empty string.'));
    }

    $raw_data = idx($spec, 'data');
    if (!is_string($raw_data)) {
      throw new PhorgeBridgeTaskSpecException(
        pht(
          'Parameter "data" must be the raw JSON string of the task\'s '.
          'worker_taskdata row.'));
    }

    return self::newTask(
      $task_id,
      $task_class,
      $raw_data,
      $failure_count,
      $priority,
      $object_phid,
      $container_phid);
  }

  /**
   * An in-memory task for the worker's getCurrentWorkerTask() and
   * getWaitBeforeRetry(); ephemeral, so nothing can ever save it. The data is
   * decoded exactly as PhabricatorWorkerTaskData reads its "data" column
   * (invalid JSON becomes null, as in Phorge).
   */
  public static function newTask(
    $task_id,
    $task_class,
    $raw_data,
    $failure_count,
    $priority,
    $object_phid,
    $container_phid) {

    $task = id(new PhabricatorWorkerActiveTask())
      ->setID((int)$task_id)
      ->setTaskClass((string)$task_class)
      ->setData(json_decode((string)$raw_data, true))
      ->setFailureCount((int)$failure_count)
      ->setPriority((int)$priority)
      ->setObjectPHID($object_phid)
      ->setContainerPHID($container_phid);
    $task->makeEphemeral();
    return $task;
  }

  /**
   * Run the task's worker once, as PhabricatorWorkerActiveTask::executeTask
   * does, and return how it ended: result, duration (microseconds),
   * followups, scheduled (the tasks the worker scheduled itself),
   * yieldDuration, retryWait, message, requiredLease, maximumRetryCount,
   * warnings and output (what the worker printed).
   */
  public static function run(PhabricatorWorkerActiveTask $task) {
    // As the taskmaster does before each task.
    PhabricatorCaches::destroyRequestCache();

    // The daemons run workers without a time limit; so must we. The bridge
    // bounds the run on its side.
    if (function_exists('set_time_limit')) {
      @set_time_limit(0);
    }

    $failure_count = (int)$task->getFailureCount();
    $result = array(
      'result' => null,
      'duration' => 0,
      'followups' => array(),
      'scheduled' => 0,
      'yieldDuration' => null,
      'retryWait' => null,
      'message' => null,
      'requiredLease' => null,
      'maximumRetryCount' => null,
      'warnings' => array(),
      'output' => '',
    );

    $worker = null;
    $caught = null;
    $buffer_level = ob_get_level();
    ob_start();
    try {
      $worker = self::newWorker($task);
      $result['maximumRetryCount'] = $worker->getMaximumRetryCount();
      self::checkRetryLimit($task, $result['maximumRetryCount']);
      $result['requiredLease'] = self::requiredLease($worker);

      $scheduled = self::scheduledSoFar();
      $t_start = microtime(true);
      $worker->executeTask();
      $result['duration'] = (int)phutil_microseconds_since($t_start);
      $result['scheduled'] = self::scheduledSoFar() - $scheduled;
      $result['result'] = self::RESULT_SUCCESS;
    } catch (PhabricatorWorkerPermanentFailureException $ex) {
      $result['result'] = self::RESULT_PERMANENT_FAILURE;
      $message = $ex->getMessage();
      if (!strlen($message)) {
        $message = get_class($ex).' (no message)';
      }
      $result['message'] = self::cleanMessage($message);
    } catch (PhabricatorWorkerYieldException $ex) {
      $result['result'] = self::RESULT_YIELD;
      $result['yieldDuration'] = max((int)$ex->getDuration(), self::MINIMUM_YIELD);
    } catch (Throwable $ex) {
      $caught = $ex;
    }

    // Whatever the worker printed is reported apart, never mixed into the
    // answer.
    $output = '';
    while (ob_get_level() > $buffer_level) {
      $output = ob_get_clean().$output;
    }
    $result['output'] = self::cleanMessage($output);

    if ($caught) {
      $result['result'] = self::RESULT_FAILURE;
      $result['message'] = self::cleanMessage(
        get_class($caught).': '.$caught->getMessage());
      $result['retryWait'] = self::waitBeforeRetry(
        $task,
        $worker,
        $caught,
        $result['warnings']);
    }

    if ($result['result'] === self::RESULT_SUCCESS) {
      $result['followups'] = self::describeFollowups(
        $worker,
        (int)$task->getPriority(),
        $result['warnings']);
    }

    return $result;
  }

  private static $scheduled = null;

  /**
   * How many tasks this process's workers scheduled themselves so far
   * (PhabricatorWorker::scheduleTask, as publishing does for search, feed and
   * mail), which bypass queueTask and so the followups: counted off Phorge's
   * query profiler, each INSERT into worker_activetask, so that the canary
   * compares all of a run's effects.
   */
  private static function scheduledSoFar() {
    if (self::$scheduled === null) {
      self::$scheduled = 0;
      if (class_exists('PhutilServiceProfiler')) {
        PhutilServiceProfiler::getInstance()->addListener(
          array(__CLASS__, 'countScheduled'));
      }
    }
    return self::$scheduled;
  }

  public static function countScheduled($type, $id, array $data) {
    $query = isset($data['query']) ? $data['query'] : '';
    if ($type === 'begin' && is_string($query) && preg_match(
        '/^\s*INSERT INTO\s+(`[^`]*`\.)?`?worker_activetask`?\s/i',
        $query)) {
      self::$scheduled++;
    }
  }

  /**
   * What the bridge must know before the run: the worker's required lease
   * and maximum retry count (a worker that cannot even be made answers with
   * nulls: its run will say why).
   */
  public static function describe(PhabricatorWorkerActiveTask $task) {
    try {
      $worker = self::newWorker($task);
      return array(
        'requiredLease' => self::requiredLease($worker),
        'maximumRetryCount' => $worker->getMaximumRetryCount(),
      );
    } catch (Throwable $ex) {
      return array('requiredLease' => null, 'maximumRetryCount' => null);
    }
  }

  /**
   * The wait after a run that died with its process (a fatal error, exit(),
   * a signal), asked of a fresh process: the worker's getWaitBeforeRetry(),
   * else Phorge's default.
   */
  public static function waitAfterDeath(
    PhabricatorWorkerActiveTask $task,
    $message) {

    $warnings = array();
    $worker = null;
    try {
      $worker = self::newWorker($task);
    } catch (Throwable $ex) {
      $worker = null;
    }
    return array(
      'retryWait' => self::waitBeforeRetry(
        $task,
        $worker,
        new Exception((string)$message),
        $warnings),
      'warnings' => $warnings,
    );
  }

  public static function cleanMessage($message) {
    // Valid UTF-8 (JSON can carry it) and bounded, cut on a character.
    $message = (string)$message;
    if (!preg_match('//u', $message)) {
      $message = phutil_utf8ize($message);
    }
    if (strlen($message) > self::MESSAGE_BYTES) {
      $message = substr($message, 0, self::MESSAGE_BYTES);
      // At most three bytes of a cut character to drop.
      while (!preg_match('//u', $message)) {
        $message = substr($message, 0, -1);
      }
    }
    return $message;
  }

  private static function readSpecInteger(array $spec, $key, $minimum) {
    $value = idx($spec, $key);
    if (is_string($value) && preg_match('/^-?\d+\z/', $value)) {
      $value = (int)$value;
    }
    if (!is_int($value) || $value < $minimum) {
      throw new PhorgeBridgeTaskSpecException(
        pht(
          'Parameter "%s" must be an integer no smaller than %d.',
          $key,
          $minimum));
    }
    return $value;
  }

  private static function readSpecOptionalString(array $spec, $key) {
    $value = idx($spec, $key);
    if ($value === null || $value === '') {
      return null;
    }
    if (!is_string($value)) {
      throw new PhorgeBridgeTaskSpecException(
        pht('Parameter "%s" must be a string or null.', $key));
    }
    return $value;
  }

  private static function requiredLease(PhabricatorWorker $worker) {
    $lease = $worker->getRequiredLeaseTime();
    return ($lease === null ? null : (int)$lease);
  }

  // Phorge's rule (PhabricatorWorkerActiveTask::executeTask).
  private static function checkRetryLimit(
    PhabricatorWorkerActiveTask $task,
    $maximum_failures) {

    if ($maximum_failures !== null &&
        $task->getFailureCount() > $maximum_failures) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht(
          'Task %d has exceeded the maximum number of failures (%d).',
          $task->getID(),
          $maximum_failures));
    }
  }

  private static function waitBeforeRetry(
    PhabricatorWorkerActiveTask $task,
    $worker,
    $exception,
    array &$warnings) {

    // As Phorge does before asking the worker for its wait: the task shows
    // the exception and the failure count including this failure.
    $task->setExecutionException($exception);
    $task->setFailureCount((int)$task->getFailureCount() + 1);
    $task->setFailureTime(time());

    $retry = null;
    if ($worker) {
      try {
        $retry = $worker->getWaitBeforeRetry($task);
      } catch (Throwable $ex) {
        $warnings[] = self::cleanMessage(
          'getWaitBeforeRetry() failed: '.$ex->getMessage());
      }
    }
    return (int)coalesce(
      $retry,
      PhabricatorWorkerLeaseQuery::getDefaultWaitBeforeRetry());
  }

  private static function newWorker(PhabricatorWorkerActiveTask $task) {
    $class = $task->getTaskClass();
    if (!preg_match('/^[A-Za-z_][A-Za-z0-9_]*\z/', $class)) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht('Task class "%s" is not a valid class name.', $class));
    }

    // Unlike the daemon (which lets the autoloader throw and so retries a
    // missing class forever), the bridge archives it: the class is unknown
    // to this Phorge.
    try {
      $exists = class_exists($class);
    } catch (Exception $ex) {
      $exists = false;
    }
    if (!$exists) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht("Task class '%s' does not exist!", $class));
    }

    if (!is_subclass_of($class, 'PhabricatorWorker')) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht(
          "Task class '%s' does not extend %s.",
          $class,
          'PhabricatorWorker'));
    }

    $reflection = new ReflectionClass($class);
    if ($reflection->isAbstract()) {
      throw new PhabricatorWorkerPermanentFailureException(
        pht("Task class '%s' is abstract.", $class));
    }

    $worker = newv($class, array($task->getData()));
    $worker->setCurrentWorkerTask($task);
    return $worker;
  }

  /**
   * The tasks the worker queued with queueTask(), as flushTaskQueue() would
   * schedule them after a success, but returned instead of scheduled: the
   * bridge inserts them in the transaction that archives this task.
   */
  private static function describeFollowups(
    PhabricatorWorker $worker,
    $priority,
    array &$warnings) {

    // getQueuedTasks() is protected; read it in PhabricatorWorker's scope.
    $reader = Closure::bind(
      function () {
        return $this->getQueuedTasks();
      },
      $worker,
      'PhabricatorWorker');
    $queued = $reader();

    $followups = array();
    foreach ($queued as $spec) {
      list($class, $data, $options) = $spec;
      if (!is_array($options)) {
        $options = array();
      }
      // flushTaskQueue() defaults follow-ups to the finished task's priority.
      $options = $options + array('priority' => $priority);

      // What scheduleTask() accepts; an invalid follow-up would make Phorge
      // throw after archiving the task, so it is left out here.
      $problem = self::followupProblem($class, $data, $options);
      if ($problem !== null) {
        $warnings[] = self::cleanMessage(
          sprintf(
            'Dropped follow-up task "%s": %s',
            is_string($class) ? $class : gettype($class),
            $problem));
        continue;
      }

      $task_priority = idx($options, 'priority');
      if ($task_priority === null) {
        // scheduleTask(): an explicit null priority means the default.
        $task_priority = PhabricatorWorker::PRIORITY_DEFAULT;
      }

      $delay = idx($options, 'delayUntil');
      $followups[] = array(
        'taskClass' => $class,
        'data' => $data,
        'options' => array(
          'priority' => (int)$task_priority,
          'objectPHID' => idx($options, 'objectPHID'),
          'containerPHID' => idx($options, 'containerPHID'),
          // scheduleTask() ignores a zero delay.
          'delayUntil' => ($delay ? (int)$delay : null),
        ),
      );
    }

    return $followups;
  }

  private static function followupProblem($class, $data, array $options) {
    if (!is_string($class) || !strlen($class)) {
      return 'Follow-up task class must be a string.';
    }
    $types = array(
      'priority' => 'is_int',
      'objectPHID' => 'is_string',
      'containerPHID' => 'is_string',
      'delayUntil' => 'is_int',
    );
    foreach ($options as $key => $value) {
      if (!isset($types[$key])) {
        return sprintf('Unknown option "%s".', $key);
      }
      if ($value !== null && !call_user_func($types[$key], $value)) {
        return sprintf('Option "%s" has the wrong type.', $key);
      }
    }
    if (@json_encode($data) === false) {
      return 'Follow-up data can not be JSON encoded: '.json_last_error_msg();
    }
    return null;
  }

}

}
